"""Checks of a version manifest, run when it is parsed: every name, size, count and offset that a
reader takes from it, before anything is allocated, downloaded or written.

Whoever can write the store writes the manifests, so a manifest is input like any other, not a
promise. :func:`check_document` refuses, with a :class:`~infra.weightsync.errors.ManifestError`
naming the field (``tensors[3].chunks[7].k``), anything that would make a reader allocate more than
``max_bytes``, index out of a list or a buffer, loop over a count the document does not back, read
an object outside its version folder, or write a file outside its output folder:

- sizes: ``nbytes == prod(shape) * itemsize`` of a known dtype, every dimension a non-negative
  integer, at most :data:`MAX_NDIM` of them; the total at most ``max_bytes`` (by default this
  machine's memory: a version that does not fit cannot be fetched into it anyway);
- counts: one chunk entry per ``chunk_bytes`` of each tensor (the count follows from the tensor's
  size, so it is computed, not trusted); ``chunk_bytes`` at most :data:`MAX_CHUNK_BYTES`;
- frames ``[shard, offset, length, digest]``: the shard one of the manifest's, the bytes inside that
  shard's recorded size (the frames the manifest object carries: inside them), the length at most
  :func:`frame_limit` of its chunk, the digest a 32-character string (it is only compared with
  the digest of the bytes, before they are decoded);
- names: shard names plain file names (they become object keys under the version folder), side-file
  digests 32 hex digits (they become ``files/<digest>`` keys), side-file and safetensors-layout
  names relative '/'-paths without ``.``/``..``/empty segments (:func:`relative_name`; the output
  folder itself is checked again when a fetch writes, see :func:`~infra.weightsync.folder.member_path`),
  tensor names unique non-empty strings, the layout naming only tensors of the version;
- kinds: the document says what it is (``kind``: ``version`` or ``snapshot``, as the reader
  expected); a delta's base is the previous version, a full version (``keyframe``) has none, a
  snapshot is keyframe frames only and carries no frames in its manifest object;
- types: JSON booleans are not integers, floats are not sizes.

The manifest object and its decompressed JSON are bounded too (:data:`MAX_MANIFEST_OBJECT`,
:data:`MAX_MANIFEST_JSON`). The checks add about half a millisecond to parsing the manifest of a
135M-parameter model (271 tensors, 284 chunks: 1.4 ms in all on the 2-vCPU VM), which a reader
does once per version.
"""

from __future__ import annotations

import math
import os
import re

from infra.weightsync.errors import ManifestError
from infra.weightsync.rawbytes import DTYPE_SIZES, word_width

MAX_MANIFEST_OBJECT = 64 << 20  # bytes of a manifest object (zstd JSON + the frames it carries)
MAX_MANIFEST_JSON = 64 << 20  # bytes of its JSON, decompressed (a 70B model's is ~5 MB)
MAX_CHUNK_BYTES = 256 << 20  # the publisher's default is 4 MiB
MAX_NDIM = 64
MAX_NAME = 1024  # characters of a tensor, shard or file name
MAX_SEGMENT = 255  # bytes of one segment of a file name (what file systems take)
MAX_ENTRIES = 1 << 20  # tensors, shards or side files in one manifest
MAX_SHARD_BYTES = 1 << 40
FRAME_SLACK = 4096  # frame header, position-stream header, zstd block headers

_HEX32 = re.compile(r"[0-9a-f]{32}\Z")
_SHARD = re.compile(r"(?:@manifest|[A-Za-z0-9][A-Za-z0-9._-]{0,127})\Z")


def default_max_bytes() -> int:
    """Physical memory of this machine (1 TiB where it cannot be read): the default bound on the
    bytes one version may declare."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 1 << 40


def frame_limit(chunk_nbytes: int) -> int:
    """Largest frame the publisher can write for a chunk of ``chunk_nbytes``: a raw or xor frame is
    zstd's bound of the chunk (+0.4%); a sparse one positions (<= 2 bits a word) plus values (<= the
    chunk's bytes, compressed); twice the chunk leaves room for all of them."""
    return 2 * chunk_nbytes + FRAME_SLACK


def _show(value: object) -> str:
    """A short, one-line rendering of a value taken from a manifest (for error messages)."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _fail(version: int, field: str, problem: str) -> ManifestError:
    return ManifestError(f"manifest {field}: {problem}", version=version)


def _int(value: object, version: int, field: str, lo: int, hi: int) -> int:
    """``value`` as an int in ``[lo, hi]`` (a JSON boolean or float is not one)."""
    if type(value) is not int or not lo <= value <= hi:
        raise _fail(version, field, f"{_show(value)} is not an integer in [{lo}, {hi}]")
    return value


def _hex32(value: object, version: int, field: str) -> str:
    if type(value) is not str or not _HEX32.match(value):
        raise _fail(version, field, f"{_show(value)} is not a digest (32 hex digits)")
    return value


def _list(value: object, version: int, field: str, most: int = MAX_ENTRIES) -> list:
    if type(value) is not list or len(value) > most:
        raise _fail(version, field, f"not a list of at most {most} entries")
    return value


def _dict(value: object, version: int, field: str, most: int = MAX_ENTRIES) -> dict:
    if type(value) is not dict or len(value) > most:
        raise _fail(version, field, f"not an object of at most {most} entries")
    return value


def _text(value: object) -> bool:
    """A string that can be written out as UTF-8 (JSON admits lone surrogates, file systems and
    safetensors headers do not)."""
    if type(value) is not str:
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def relative_name(rel: object, field: str, version: int | None = None) -> str:
    """``rel`` if it is a plain relative '/'-path: a non-empty UTF-8 string of at most
    :data:`MAX_NAME` characters, no leading '/', no backslash or NUL, no empty, ``.`` or ``..``
    segment, no segment over :data:`MAX_SEGMENT` bytes. Raises :class:`ManifestError` naming ``field``."""
    if (not isinstance(rel, str) or not _text(rel) or not rel or len(rel) > MAX_NAME or rel.startswith("/")
            or "\\" in rel or "\0" in rel):
        raise ManifestError(f"manifest {field}: file name {_show(rel)} is not a relative path", version=version)
    if any(part in ("", ".", "..") or len(part.encode()) > MAX_SEGMENT for part in rel.split("/")):
        raise ManifestError(f"manifest {field}: file name {_show(rel)} has an empty, '.', '..' or overlong "
                            "segment", version=version)
    return rel


def _check_outputs(names: list[str], version: int) -> None:
    """The files a fetch writes (side files and safetensors files) neither repeat a name nor use
    one as another's folder (``a`` and ``a/b``): either would fail half-way through writing."""
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise _fail(version, "files", f"{_show(name)} is named twice (side files and meta.safetensors)")
        seen.add(name)
    for name in names:
        parts = name.split("/")
        for i in range(1, len(parts)):
            if "/".join(parts[:i]) in seen:
                raise _fail(version, "files", f"{_show(name)} is inside {_show('/'.join(parts[:i]))}, "
                            "which is a file too")


def check_document(doc: object, version: int, tail_bytes: int, max_bytes: int, snapshot: bool = False) -> None:
    """Check a decoded manifest JSON document of ``version`` (see the module docstring);
    ``tail_bytes``: how many bytes of frames the manifest object carries after its JSON;
    ``snapshot``: the document must be a snapshot's manifest (else a version's)."""
    doc = _dict(doc, version, "document", 64)
    kind = "snapshot" if snapshot else "version"
    if doc.get("kind") != kind:
        raise _fail(version, "kind", f"{_show(doc.get('kind'))} where a {kind} manifest was expected")
    if doc.get("version") != version or type(doc.get("version")) is not int:
        raise _fail(version, "version", f"says {_show(doc.get('version'))}")
    if type(doc.get("keyframe")) is not bool:
        raise _fail(version, "keyframe", f"{_show(doc.get('keyframe'))} is not true or false")
    if doc.get("base") is not None:
        _int(doc["base"], version, "base", version - 1, version - 1)
        if doc["keyframe"]:
            raise _fail(version, "base", "a full version (keyframe) has no base")
    elif not doc["keyframe"]:
        raise _fail(version, "base", "a delta version needs its base (the previous version)")
    if snapshot and (not doc["keyframe"] or tail_bytes):
        raise _fail(version, "keyframe", "a snapshot holds keyframe frames only, in its own shards")
    chunk_bytes = _int(doc.get("chunk_bytes"), version, "chunk_bytes", 1, MAX_CHUNK_BYTES)
    sizes = _check_shards(doc, version, tail_bytes)
    names = _check_tensors(doc, version, chunk_bytes, sizes, max_bytes)
    files = _dict(doc.get("files", {}), version, "files")
    for name, h in files.items():
        relative_name(name, "files", version)
        _hex32(h, version, f"files[{_show(name)}]")
    layout = _check_layout(_dict(doc.get("meta", {}), version, "meta"), names, version)
    _check_outputs([*files, *layout], version)


def _check_shards(doc: dict, version: int, tail_bytes: int) -> list[int]:
    """Shard names (plain names, unique, ``@manifest`` only when frames are carried) and their sizes."""
    shards = _list(doc.get("shards"), version, "shards")
    sizes = _list(doc.get("shard_sizes"), version, "shard_sizes")
    if len(sizes) != len(shards):
        raise _fail(version, "shard_sizes", f"{len(sizes)} sizes for {len(shards)} shards")
    for i, name in enumerate(shards):
        if type(name) is not str or not _SHARD.match(name):
            raise _fail(version, f"shards[{i}]", f"{_show(name)} is not a plain shard name")
        lo, hi = (tail_bytes, tail_bytes) if name == "@manifest" else (0, MAX_SHARD_BYTES)
        _int(sizes[i], version, f"shard_sizes[{i}]", lo, hi)
    if len(set(shards)) != len(shards):
        raise _fail(version, "shards", "a shard name appears twice")
    if tail_bytes and "@manifest" not in shards:
        raise _fail(version, "shards", f"the object carries {tail_bytes} bytes of frames no shard names")
    return sizes


def _check_tensors(doc: dict, version: int, chunk_bytes: int, sizes: list[int], max_bytes: int) -> set[str]:
    """Every tensor entry; returns the tensor names."""
    tensors = _list(doc.get("tensors"), version, "tensors")
    keyframe, delta = doc["keyframe"], doc.get("base") is not None
    names: set[str] = set()
    total = 0
    for ti, t in enumerate(tensors):
        at = f"tensors[{ti}]"
        t = _dict(t, version, at, 16)
        name = t.get("name")
        if not isinstance(name, str) or not _text(name) or not name or len(name) > MAX_NAME or "\0" in name:
            raise _fail(version, f"{at}.name", f"{_show(name)} is not a tensor name")
        if name in names:
            raise _fail(version, f"{at}.name", f"{_show(name)} appears twice")
        names.add(name)
        nbytes = _tensor_size(t, version, at, max_bytes - total)
        total += nbytes
        _hex32(t.get("h"), version, f"{at}.h")
        width = word_width(DTYPE_SIZES[t["dtype"]])
        step = max(1, chunk_bytes // width)
        nwords = nbytes // width
        chunks = _list(t.get("chunks"), version, f"{at}.chunks")
        if len(chunks) != -(-nwords // step):
            raise _fail(version, f"{at}.chunks", f"{len(chunks)} entries; {nbytes} bytes in chunks of "
                        f"{step * width} make {-(-nwords // step)}")
        limit = frame_limit(min(step, nwords) * width)
        for ci, c in enumerate(chunks):  # (the common case in a few inline tests; the slow path names the field)
            if type(c) is dict:
                k, d, h = c.get("k"), c.get("d"), c.get("h")
                if (type(h) is str and len(h) == 32 and (k is None) != keyframe and (d is None or delta)
                        and (k is None or _frame_ok(k, sizes, limit)) and (d is None or _frame_ok(d, sizes, limit))):
                    continue
            _check_chunk(c, version, f"{at}.chunks[{ci}]", sizes, limit, keyframe, delta)
    return names


def _frame_ok(loc: object, sizes: list[int], limit: int) -> bool:
    """Is ``loc`` a frame ``[shard, offset, length, digest]`` inside its shard, at most ``limit`` long?"""
    if type(loc) is not list or len(loc) != 4:
        return False
    shard, offset, length, h = loc
    return (type(shard) is int and 0 <= shard < len(sizes) and type(length) is int and 1 <= length <= limit
            and type(offset) is int and 0 <= offset <= sizes[shard] - length and type(h) is str and len(h) == 32)


def _tensor_size(t: dict, version: int, at: str, room: int) -> int:
    """A tensor's ``nbytes``, checked against its dtype and shape and against the ``room`` left
    under the version's bound."""
    dtype = t.get("dtype")
    if type(dtype) is not str or dtype not in DTYPE_SIZES:
        raise _fail(version, f"{at}.dtype", f"{_show(dtype)} is not a supported dtype")
    shape = _list(t.get("shape"), version, f"{at}.shape", MAX_NDIM)
    if not all(type(d) is int and d >= 0 for d in shape):
        raise _fail(version, f"{at}.shape", f"{_show(shape)} is not a list of non-negative integers")
    nbytes = t.get("nbytes")
    if type(nbytes) is not int or nbytes != math.prod(shape) * DTYPE_SIZES[dtype]:
        raise _fail(version, f"{at}.nbytes", f"{_show(nbytes)} is not shape {_show(shape)} x "
                    f"{DTYPE_SIZES[dtype]} bytes ({dtype})")
    if nbytes > room:
        raise _fail(version, f"{at}.nbytes", f"{nbytes} bytes take the version over max_bytes "
                    f"({room} bytes left)")
    return nbytes


def _check_chunk(c: object, version: int, at: str, sizes: list[int], limit: int, keyframe: bool,
                 delta: bool) -> None:
    """One chunk entry: its digest, and a frame ``k`` exactly in keyframe versions, ``d`` only in
    versions with a base; raises naming the field. (Digests of chunks and frames are only compared
    with digests computed here, so any 32-character string will do; side-file digests, which
    become object keys, must be hex.)"""
    if type(c) is not dict:
        raise _fail(version, at, "not an object")
    if type(c.get("h")) is not str or len(c["h"]) != 32:
        raise _fail(version, f"{at}.h", f"{_show(c.get('h'))} is not a digest")
    for kind, allowed in (("k", keyframe), ("d", delta)):
        loc = c.get(kind)
        if loc is None:
            if kind == "k" and keyframe:
                raise _fail(version, f"{at}.k", "a keyframe version lacks this chunk's keyframe frame")
            continue
        field = f"{at}.{kind}"
        if not allowed:
            raise _fail(version, field, "a frame this version cannot have")
        if type(loc) is not list or len(loc) != 4:
            raise _fail(version, field, f"{_show(loc)} is not [shard, offset, length, digest]")
        shard = _int(loc[0], version, field, 0, len(sizes) - 1)
        length = _int(loc[2], version, field, 1, limit)
        _int(loc[1], version, field, 0, sizes[shard] - length)
        if type(loc[3]) is not str or len(loc[3]) != 32:
            raise _fail(version, field, f"frame digest {_show(loc[3])} is not a digest")
    raise _fail(version, at, "not a chunk entry")


def _check_layout(meta: dict, names: set[str], version: int) -> list[str]:
    """``meta.safetensors`` (the file layout ``sync fetch`` writes): relative file names, each
    listing tensors of this version and string-to-string metadata. Returns the file names."""
    if "safetensors" not in meta:
        return []
    field = "meta.safetensors"
    layout = _dict(meta["safetensors"], version, field)
    for rel, spec in layout.items():
        relative_name(rel, field, version)
        at = f"{field}[{_show(rel)}]"
        spec = _dict(spec, version, at, 16)
        listed = _list(spec.get("tensors"), version, f"{at}.tensors")
        unknown = [n for n in listed if type(n) is not str or n not in names]
        if unknown:
            raise _fail(version, f"{at}.tensors", f"{_show(unknown[0])} is not a tensor of this version")
        metadata = spec.get("metadata")
        if metadata is not None and (type(metadata) is not dict or not all(
                _text(k) and _text(v) for k, v in metadata.items())):
            raise _fail(version, f"{at}.metadata", "not an object of strings")
    return list(layout)
