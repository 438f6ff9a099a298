"""The runner that lives *inside* a warm sandbox (stdlib only; runs on the sandbox's python3).

Why: starting a sandbox costs tens (bwrap) to hundreds (docker) of milliseconds, while a scoring job
is a few milliseconds of Python. So one sandbox serves many jobs, and each job must still start from
a clean state and be unable to forge its own score. Three processes, all the same non-root uid:

* **runner (R)** — PID 1 of the sandbox's PID namespace (bwrap ``--as-pid-1``; docker's command).
  The kernel never delivers SIGKILL/SIGSTOP to a namespace's init from inside that namespace, so the
  untrusted job cannot kill or stop it, and R ignores every catchable signal (:func:`_set_signals`).
  R is non-dumpable (no ptrace, no ``/proc/1/mem`` or
  ``/proc/1/fd`` access for the job). R reads one JSON job per line on stdin and writes one JSON
  reply per line on stdout; the job never holds these fds.
* **zygote (Z)** — a fresh ``exec`` of python made at sandbox start, holding no job data. For each
  job it forks a worker, reports its pid and, after ``waitpid``, its exit status to R over a private
  socket (closed in the worker).
* **worker (W)** — the fork of Z that runs the untrusted program: new session, stdin ``/dev/null``,
  stdout/stderr/results on three pipes read by R, hard rlimits (address space, CPU, file size, fds,
  optionally processes), cwd the tmpfs scratch.

Results are *values*: W sends back what ``entry(*args)`` returned, as JSON, on fd 3. The expected
answers never enter the sandbox; the trusted host compares. A program that writes fake values to fd 3
only forges its own outputs, which is what it is graded on anyway.

**Tests mode** (``mode: "tests"``: trusted assert-style tests against an untrusted program) runs a
job in TWO forks of Z instead of one:

* **callee (W1, untrusted)** — execs the program, reports the names of its top-level callables, then
  serves calls: it reads ``[name, repr(args), repr(kwargs)]`` frames on fd 3, calls the function and
  writes ``["ok", repr(value)]`` (or ``["exc", type name]``) frames on fd 4. Values cross as TEXT.
* **tester (W2, trusted)** — never runs program code. It reads the tests, their trusted ``context``
  and the entry name on a socket (fd 4) that only R writes, so neither Z nor W1 ever holds the
  tests (W1 is a fork of Z: what Z once held, W1 could read in its own memory). It execs ``context``
  then binds a stub per program callable (never over a builtin or a name the context defines; the
  entry also as ``candidate``), execs ``tests`` (which rebind over stubs), runs ``check(candidate)``
  when the tests define ``check`` and every ``test_*`` function they define, and writes its verdict
  on fd 3, a pipe only it holds. A stub's reply is decoded with ``ast.literal_eval`` (size-capped):
  anything that is not a literal makes that call raise, so no object of the program's making (an
  ``__eq__`` that is always true) ever reaches the tests. W2 is non-dumpable, so W1 (same uid) can
  neither ptrace it nor open ``/proc/W2/{fd,mem}``; W1 can only kill or stop it, which ends as a
  missing verdict (a failure) or a timeout.

R ends the job when W2's exit status arrives, then kills W1's process group; the overall timeout
kills both. The host passes a request only on W2's ``{"phase": "tests", "passed": true}`` with exit
status 0 and no timeout or output cap.

After every job R kills W's process group, reaps orphans, lists ``/proc`` and reports an *anomaly*
if any process other than R and Z survived (then it kills them all with ``kill(-1)``; the host
retires the sandbox), and wipes the writable dirs (scratch, ``/dev/shm``). When R cannot start a
zygote for a job (so the job never ran), its reply carries ``"infra": true``: the failure is the
sandbox's, and the host retries the job on a fresh one.

Invocation (host side builds it): ``python3 -I -S -B -c "import sys;exec(sys.argv[1])" SOURCE MODE
OPTIONS_JSON``; MODE is ``--runner``, ``--zygote FD`` or ``--oneshot [JOB_JSON]`` (run one job and print the
reply: the no-pool baseline of the benchmark).
"""

import ast
import builtins
import fcntl
import json
import keyword
import os
import resource
import select
import shutil
import signal
import socket
import struct
import sys
import time

BOOT = "import sys;exec(sys.argv[1])"
MEM_MARK = b'{"phase":"memory"}'
_READ = 65536


# ------------------------------------------------------------------------------------- helpers
def _nondumpable():
    """PR_SET_DUMPABLE 0: same-uid processes may not ptrace us or open our /proc files."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE = 4
    except Exception:
        pass


def _write_all(fd, data):
    view = memoryview(data)
    while view:
        try:
            n = os.write(fd, view)
        except InterruptedError:
            continue
        view = view[n:]


def _send_line(obj):
    _write_all(1, json.dumps(obj, separators=(",", ":")).encode() + b"\n")


class _Tail:
    """Counts bytes and keeps the last ``keep`` of them."""

    def __init__(self, keep):
        self.keep = keep
        self.buf = bytearray()
        self.total = 0

    def add(self, data):
        self.total += len(data)
        self.buf += data
        if len(self.buf) > 2 * self.keep:
            del self.buf[: len(self.buf) - self.keep]

    def text(self):
        return bytes(self.buf[-self.keep :]).decode("utf-8", "replace") if self.keep else ""


def _oom_count():
    """The cgroup's oom_kill counter (v2 or v1), or -1 when not visible."""
    for path in ("/sys/fs/cgroup/memory.events", "/sys/fs/cgroup/memory/memory.oom_control"):
        try:
            with open(path) as fh:
                for line in fh:
                    if line.startswith("oom_kill "):
                        return int(line.split()[1])
        except (OSError, ValueError):
            continue
    return -1


def _wipe(path):
    """Delete everything under ``path`` (making dirs writable first). Returns True if now empty."""
    try:
        entries = list(os.scandir(path))
    except FileNotFoundError:
        return True
    except OSError:
        return False

    def onerror(func, p, exc):
        try:
            os.chmod(os.path.dirname(p) or p, 0o700)
            os.chmod(p, 0o700)
        except OSError:
            pass
        try:
            if os.path.isdir(p) and not os.path.islink(p):
                shutil.rmtree(p, ignore_errors=True)
            else:
                os.unlink(p)
        except OSError:
            pass

    for e in entries:
        try:
            if e.is_dir(follow_symlinks=False):
                try:
                    os.chmod(e.path, 0o700)
                except OSError:
                    pass
                shutil.rmtree(e.path, onerror=onerror)
            else:
                os.unlink(e.path)
        except OSError:
            pass
    try:
        return not os.listdir(path)
    except OSError:
        return False


# -------------------------------------------------------------------------------- worker (W)
def _set_limits(opts, timeout):
    def hard(which, value):
        if value is None:
            return
        try:
            resource.setrlimit(which, (value, value))
        except (ValueError, OSError):
            pass

    hard(resource.RLIMIT_AS, opts.get("memory_bytes"))
    hard(resource.RLIMIT_CPU, int(timeout) + 2)
    hard(resource.RLIMIT_FSIZE, opts.get("fsize_bytes"))
    hard(resource.RLIMIT_NOFILE, opts.get("nofile", 256))
    hard(resource.RLIMIT_CORE, 0)
    hard(resource.RLIMIT_NPROC, opts.get("nproc"))


def _encode_value(value):
    try:
        return ["ok", json.loads(json.dumps(value))]
    except Exception:
        try:
            shown = repr(value)[:200]
        except Exception:
            shown = "<unrepresentable>"
        return ["unserializable", shown]


def _harness(job):
    """Run the job's program in this (worker) process; returns the exit status."""
    import builtins
    import traceback

    program = job["program"]
    glb = {"__name__": "__main__" if job["mode"] == "exec" else "__program__", "__builtins__": builtins}
    if job["mode"] == "exec":
        try:
            exec(compile(program, "<program>", "exec"), glb)
            return 0
        except SystemExit as exc:
            code = exc.code
            if code is None:
                return 0
            if isinstance(code, int):
                return code & 0xFF
            try:
                sys.stderr.write(str(code) + "\n")
            except Exception:
                pass
            return 1
        except MemoryError:
            os.write(3, MEM_MARK)
            return 1
        except BaseException:
            traceback.print_exc()
            return 1

    def report(obj):
        _write_all(3, json.dumps(obj, separators=(",", ":")).encode())

    try:
        code = compile(program, "<program>", "exec")
    except (SyntaxError, ValueError) as exc:
        report({"phase": "syntax", "msg": str(exc)[:500]})
        return 0
    try:
        exec(code, glb)
    except MemoryError:
        os.write(3, MEM_MARK)
        return 1
    except BaseException:
        traceback.print_exc()
        report({"phase": "load_error"})
        return 1
    fn = glb.get(job["entry"])
    if not callable(fn):
        report({"phase": "no_entry", "msg": "no callable named %r" % job["entry"]})
        return 1
    results = []
    try:
        for args in job["args"]:
            try:
                value = fn(*args)
            except MemoryError:
                raise
            except Exception as exc:
                results.append(["exception", type(exc).__name__])
                continue
            results.append(_encode_value(value))
    except MemoryError:
        results = None
        os.write(3, MEM_MARK)
        return 1
    report({"phase": "done", "results": results})
    return 0


# ------------------------------------------------------------------ tests mode: W1 and W2
FRAME_MAX = 1 << 22  # bytes of one call or reply frame between the callee and the tester
#: Stdlib modules the tester imports itself when the program imported them (tests written to run in
#: the program's namespace use them without an import of their own).
TEST_MODULES = frozenset((
    "math", "cmath", "re", "string", "itertools", "functools", "collections", "heapq", "bisect",
    "fractions", "decimal", "statistics", "random", "operator", "typing", "datetime", "copy", "json",
    "hashlib", "array", "numbers", "sys", "collections.abc", "os.path"))
_MAX_NAMES = 1000


def plain_name(name):
    """True for a name a stub may be bound under: an identifier, not a keyword, not a dunder."""
    return (isinstance(name, str) and name.isidentifier() and not keyword.iskeyword(name)
            and not (name.startswith("__") and name.endswith("__")))


class _Specials(ast.NodeTransformer):
    """``inf`` and ``nan`` (how ``repr`` writes those floats) as float constants."""

    def visit_Name(self, node):
        if node.id in ("inf", "nan"):
            return ast.copy_location(ast.Constant(float(node.id)), node)
        return node


def decode_literal(text, cap=FRAME_MAX):
    """``repr`` text -> value through ``ast.literal_eval`` only (plus ``inf``/``nan``). Raises
    ``ValueError`` for anything else: a call, a name, an oversized or too deeply nested text."""
    if not isinstance(text, str) or len(text) > cap:
        raise ValueError("not a literal (or longer than %d)" % cap)
    try:
        try:
            return ast.literal_eval(text)
        except ValueError:
            if "inf" not in text and "nan" not in text:
                raise
            return ast.literal_eval(_Specials().visit(ast.parse(text.strip(), mode="eval")))
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError) as exc:
        raise ValueError("not a literal (%s)" % type(exc).__name__) from None


def _read_exact(fd, n):
    buf = bytearray()
    while len(buf) < n:
        try:
            chunk = os.read(fd, min(n - len(buf), _READ))
        except InterruptedError:
            continue
        if not chunk:
            raise EOFError
        buf += chunk
    return bytes(buf)


def send_frame(fd, obj):
    """Write one length-prefixed JSON frame."""
    data = json.dumps(obj, separators=(",", ":")).encode()
    _write_all(fd, struct.pack("<I", len(data)) + data)


def recv_frame(fd, cap=FRAME_MAX):
    """Read one length-prefixed JSON frame (``ValueError`` when over ``cap``, ``EOFError`` at end)."""
    (n,) = struct.unpack("<I", _read_exact(fd, 4))
    if n > cap:
        raise ValueError("frame too large")
    return json.loads(_read_exact(fd, n))


def _callee(job):
    """W1 (untrusted): exec the program, report its callables and stdlib modules on fd 4, then
    serve calls read on fd 3 until EOF."""
    import traceback

    glb = {"__name__": "__program__", "__builtins__": builtins}
    try:
        code = compile(job["program"], "<program>", "exec")
    except (SyntaxError, ValueError) as exc:
        send_frame(4, ["syntax", str(exc)[:500]])
        return 0
    try:
        exec(code, glb)
    except BaseException as exc:
        traceback.print_exc()
        send_frame(4, ["load_error", type(exc).__name__[:100]])
        return 1
    names, modules = [], {}
    for key, value in list(glb.items()):
        if plain_name(key) and callable(value):
            names.append(key)
        elif plain_name(key) and type(value).__name__ == "module":
            modules[key] = str(getattr(value, "__name__", ""))[:200]
    send_frame(4, ["names", names[:_MAX_NAMES], dict(list(modules.items())[:_MAX_NAMES])])
    while True:
        try:
            req = recv_frame(3)
        except (EOFError, OSError, ValueError):
            return 0
        send_frame(4, serve_call(glb, req))


def serve_call(glb, req):
    """One call in W1: ``["ok", repr(value)]`` or ``["exc", exception type name]``."""
    try:
        name, args, kwargs = req
        text = repr(glb[name](*decode_literal(args), **decode_literal(kwargs)))
    except BaseException as exc:
        return ["exc", type(exc).__name__[:100]]
    if len(text) > FRAME_MAX - 64:
        return ["exc", "OverflowError"]
    return ["ok", text]


class _Channel:
    """The tester's end of the call pipes: one call at a time; replies decoded as literals only."""

    def __init__(self, rfd, wfd):
        self.rfd, self.wfd, self.broken = rfd, wfd, ""

    def __call__(self, name, args, kwargs):
        if self.broken:
            raise RuntimeError(self.broken)
        try:
            send_frame(self.wfd, [name, repr(args), repr(kwargs)])
            reply = recv_frame(self.rfd)
        except (OSError, EOFError, ValueError, RecursionError, struct.error) as exc:
            self.broken = "the program's process is gone (%s)" % type(exc).__name__
            raise RuntimeError(self.broken) from None
        return reply_value(reply)


def reply_value(reply):
    """A callee's reply -> the returned literal, or the program's exception raised again as the
    builtin ``Exception`` subclass of that name (``RuntimeError`` for any other name)."""
    if isinstance(reply, list) and len(reply) == 2 and reply[0] == "ok":
        try:
            return decode_literal(reply[1])
        except ValueError:
            raise TypeError("the program returned a value that is not a literal") from None
    if isinstance(reply, list) and len(reply) == 2 and reply[0] == "exc" and isinstance(reply[1], str):
        cls = getattr(builtins, reply[1], None) if plain_name(reply[1]) else None
        if not (isinstance(cls, type) and issubclass(cls, Exception)):
            cls = RuntimeError
        raise cls("raised in the program: %s" % reply[1][:100])
    raise RuntimeError("bad reply from the program")


def _stub(name, call):
    def stub(*args, **kwargs):
        return call(name, args, kwargs)

    stub.__name__ = stub.__qualname__ = name
    return stub


def bind_program(ns, hello, entry, call):
    """Bind a forwarding stub per program callable into the tests' namespace ``ns`` — never over a
    builtin or a name the trusted context defined (a helper such as HumanEval's ``poly`` stays
    trusted); the entry always, also as ``candidate``. Stdlib modules the program imported are
    imported here too (the tester's own copy) for tests that use them without importing."""
    names = hello[1] if len(hello) > 1 and isinstance(hello[1], list) else []
    for name in names[:_MAX_NAMES]:
        if plain_name(name) and (name == entry or (name not in ns and not hasattr(builtins, name)
                                                   and name != "candidate")):
            ns[name] = _stub(name, call)
    if entry:
        ns["candidate"] = ns[entry]
    modules = hello[2] if len(hello) > 2 and isinstance(hello[2], dict) else {}
    for alias, modname in list(modules.items())[:_MAX_NAMES]:
        if plain_name(alias) and alias not in ns and modname in TEST_MODULES:
            ns[alias] = __import__(modname, fromlist=["_"])


def call_plan(tree):
    """What to call after executing the tests: ``check`` (with ``candidate``) when the tests define
    it at top level, then every top-level ``test_*`` function. None when the tests contain no
    ``assert`` and nothing to call: they would pass any program."""
    funcs = [n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    plan = (["check"] if "check" in funcs else []) + [f for f in funcs if f.startswith("test_")]
    if not plan and not any(isinstance(n, ast.Assert) for n in ast.walk(tree)):
        return None
    return plan


def run_tests(context, tests, entry, hello, call):
    """The tester's verdict (a dict for the host) on trusted ``tests`` and ``context`` against the
    program behind ``call(name, args, kwargs)``, whose callables the callee listed in ``hello``."""
    if not (isinstance(hello, list) and hello and hello[0] == "names"):
        phase = hello[0] if isinstance(hello, list) and hello and hello[0] == "syntax" else "load_error"
        return {"phase": phase, "msg": "program: %s" % str(hello[1] if len(hello) > 1 else "")[:500]}
    if entry and entry not in (hello[1] if len(hello) > 1 and isinstance(hello[1], list) else []):
        return {"phase": "no_entry", "msg": "the program defines no callable %r" % entry}
    try:
        tree = ast.parse(tests, "<tests>")
        plan = call_plan(tree)
        if plan is None or ("check" in plan and not entry):
            raise ValueError("nothing to run" if plan is None else "check(candidate) needs an entry")
        ns = {"__name__": "__tests__", "__builtins__": builtins}
        exec(compile(context, "<context>", "exec"), ns)
    except Exception as exc:
        return {"phase": "bad_tests", "msg": ("%s: %s" % (type(exc).__name__, exc))[:500]}
    try:
        bind_program(ns, hello, entry, call)
        exec(compile(tree, "<tests>", "exec"), ns)
        for name in plan:
            ns[name](ns["candidate"]) if name == "check" else ns[name]()
    except BaseException as exc:
        return {"phase": "tests", "passed": False, "error": type(exc).__name__, "msg": _failure(exc, tests)}
    return {"phase": "tests", "passed": True}


def _failure(exc, tests):
    """``Type: message`` plus the innermost line of the tests it came from."""
    import traceback

    text = "%s: %s" % (type(exc).__name__, exc)
    lines = [f.lineno for f in traceback.extract_tb(exc.__traceback__) if f.filename == "<tests>"]
    source = tests.splitlines()
    if lines and 0 < lines[-1] <= len(source):
        text += " (tests line %d: %s)" % (lines[-1], source[lines[-1] - 1].strip())
    return text[:500]


def _read_to_end(fd):
    chunks = []
    while True:
        data = os.read(fd, _READ)
        if not data:
            return b"".join(chunks)
        chunks.append(data)


def _tester(job):
    """W2 (trusted): tests from R on fd 4, the callee's replies on fd 5, calls out on fd 6, the
    verdict on fd 3. Runs no program code."""
    _nondumpable()
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)  # a dead callee is an exception, not a signal
    os.chdir("/")
    spec, hello = None, ["load_error", "the program's process is gone"]
    try:
        spec = json.loads(_read_to_end(4))
        hello = recv_frame(5)
    except (OSError, EOFError, ValueError, RecursionError, struct.error):
        pass
    if not isinstance(spec, dict) or not isinstance(spec.get("tests"), str):
        report = {"phase": "bad_tests", "msg": "no tests received"}
    else:
        report = run_tests(spec.get("context") or "", spec["tests"], spec.get("entry") or None, hello,
                           _Channel(5, 6))
    if report.get("msg") and not report.get("passed"):
        sys.stderr.write("tests: %s\n" % report["msg"])
    _write_all(3, json.dumps(report, separators=(",", ":")).encode())
    return 0


def _worker_main(job, fds, opts, body=None):
    """Body of a forked worker: isolate, limit, run ``body(job)`` (the harness by default) with
    ``fds`` as fds 1, 2, 3, ..., ``_exit``. Never returns."""
    status = 1
    try:
        os.setsid()
        high = [fcntl.fcntl(f, fcntl.F_DUPFD, 64) for f in fds]  # above every target fd
        null = os.open("/dev/null", os.O_RDONLY)
        os.dup2(null, 0)
        for target, fd in enumerate(high, 1):
            os.dup2(fd, target)
        os.closerange(len(high) + 1, 1 << 16)  # incl. the zygote's socket and the other worker's fds
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGPIPE, signal.SIGCHLD, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        _set_limits(opts, float(job["timeout"]))
        os.chdir(opts["scratch"])
        import io
        import threading

        threading.stack_size(1 << 20)  # thread stacks count against RLIMIT_AS: keep them small

        sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)
        sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True)
        status = (body or _harness)(job)
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except BaseException:
                pass
    except MemoryError:
        try:
            os.write(3, MEM_MARK)
        except OSError:
            pass
    except BaseException:
        pass
    os._exit(status)


# ------------------------------------------------------------------------------- zygote (Z)
def _recv_exact(sock, n):
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return bytes(buf)


def zygote_main(fd, opts):
    """Fork one worker per job message; report ``P pid`` then ``X pid status`` to the runner."""
    _nondumpable()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Warm the modules scoring programs commonly import, so a worker pays nothing for them.
    for name in ("math", "re", "itertools", "functools", "collections", "random", "string",
                 "heapq", "bisect", "fractions", "statistics", "typing", "io", "traceback", "builtins",
                 "threading"):
        try:
            __import__(name)
        except Exception:
            pass
    # Freeze the heap: a forked worker then never has its collector walk (and so write to, and so
    # copy-on-write fault) the pages of every object inherited from us. ~40% of a short job's time.
    import gc

    gc.collect()
    gc.freeze()
    sock = socket.socket(fileno=fd)
    sock.sendall(b"R")  # ready: the runner waits for this, so a job never pays our start-up
    while True:
        try:
            head, fds, _flags, _addr = socket.recv_fds(sock, 8, 4)
            if not head:
                os._exit(0)
            if len(head) < 8:
                head += _recv_exact(sock, 8 - len(head))
            (size,) = struct.unpack("<Q", head)
            job = json.loads(_recv_exact(sock, size))
        except (EOFError, OSError, ValueError):
            os._exit(0)
        started = _start_job(sock, job, fds, opts)
        for f in fds:
            os.close(f)
        for kind, pid in started:
            sock.sendall(kind + struct.pack("<q", pid))
        waiting = {pid for _, pid in started}
        while waiting:
            try:
                pid, status = os.waitpid(-1, 0)
            except InterruptedError:
                continue
            if pid in waiting:
                waiting.discard(pid)
                sock.sendall(b"X" + struct.pack("<qq", pid, status))


def _fork_worker(sock, job, fds, opts, body):
    pid = os.fork()
    if pid == 0:
        sock.close()
        _worker_main(job, fds, opts, body)
    return pid


def _start_job(sock, job, fds, opts):
    """Fork the job's worker(s): ``[(b"P", pid)]``, the worker whose exit ends the job; a tests job
    also ``(b"C", pid)``, its callee. The callee gets only stdout, stderr and its call pipes."""
    if job.get("mode") != "tests":
        return [(b"P", _fork_worker(sock, job, fds, opts, _harness))]
    out, err, verdict, feed = fds
    req_r, req_w = os.pipe()
    rep_r, rep_w = os.pipe()
    try:
        callee = _fork_worker(sock, job, [out, err, req_r, rep_w], opts, _callee)
        tester = _fork_worker(sock, job, [out, err, verdict, feed, rep_r, req_w], opts, _tester)
    finally:
        for f in (req_r, req_w, rep_r, rep_w):
            os.close(f)
    return [(b"C", callee), (b"P", tester)]


def _drain(readers, open_fds, cap):
    """Read what is already buffered in the still-open pipes without blocking (orphans may keep a
    pipe open: never wait for EOF), at most ``cap`` bytes a pipe."""
    for fd in list(open_fds):
        try:
            os.set_blocking(fd, False)
            while True:
                data = os.read(fd, _READ)
                if not data:
                    break
                readers[fd].add(data)
                if readers[fd].total > cap:
                    break
        except (BlockingIOError, OSError):
            pass


# ------------------------------------------------------------------------------- runner (R)
class Runner:
    """The trusted per-sandbox loop (see the module docstring)."""

    def __init__(self, source, opts):
        self.source = source
        self.opts = opts
        self.pid1 = os.getpid() == 1
        self.zpid = None
        self.zsock = None
        self.zbuf = b""
        self.workers = {}  # this job's worker pids by kind: "P" ends the job, "C" a tests job's callee
        self.exits = {}  # pid -> (wait status, monotonic time) of this job's workers
        self.feed = None  # [socket, bytes still to send] of a tests job's tester

    # zygote management
    def spawn_zygote(self):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        argv = [sys.executable, "-I", "-S", "-B", "-c", BOOT, self.source, "--zygote",
                str(theirs.fileno()), json.dumps(self.opts)]
        pid = os.fork()
        if pid == 0:
            try:
                null = os.open("/dev/null", os.O_RDWR)
                for target in (0, 1, 2):
                    os.dup2(null, target)
                keep = theirs.fileno()
                os.closerange(3, keep)
                os.closerange(keep + 1, 1 << 16)
                os.set_inheritable(keep, True)
                _set_signals(signal.SIG_DFL)  # the zygote starts as a plain python3 would
                os.execv(sys.executable, argv)
            finally:
                os._exit(127)
        theirs.close()
        self.zpid, self.zsock, self.zbuf = pid, ours, b""
        ready, _, _ = select.select([ours], [], [], 60.0)
        if not ready or ours.recv(1) != b"R":
            raise RuntimeError("zygote did not start")

    def _zmsg(self):
        """Parse one complete zygote message from the buffer, or None."""
        if self.zbuf[:1] in (b"P", b"C") and len(self.zbuf) >= 9:
            msg = (self.zbuf[:1].decode(), struct.unpack("<q", self.zbuf[1:9])[0], None)
            self.zbuf = self.zbuf[9:]
            return msg
        if self.zbuf[:1] == b"X" and len(self.zbuf) >= 17:
            pid, status = struct.unpack("<qq", self.zbuf[1:17])
            self.zbuf = self.zbuf[17:]
            return ("X", pid, status)
        return None

    def _recv_zmsgs(self):
        """Read what the zygote sent (one recv) and return the complete messages in it, or None
        when the zygote closed its socket."""
        data = self.zsock.recv(64)
        if not data:
            return None
        self.zbuf += data
        msgs = []
        msg = self._zmsg()
        while msg is not None:
            msgs.append(msg)
            msg = self._zmsg()
        return msgs

    # process hygiene
    def _reap(self):
        """Reap every exited child/orphan without blocking; note if the zygote died."""
        while True:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if pid == self.zpid:
                self.zpid = None

    def _strays(self):
        """Pids in our namespace other than R and Z (only meaningful as PID 1)."""
        keep = {1, os.getpid(), self.zpid}
        out = []
        for name in os.listdir("/proc"):
            if name.isdigit() and int(name) not in keep:
                try:
                    with open("/proc/%s/stat" % name) as fh:
                        if fh.read().rsplit(")", 1)[1].split()[0] == "Z":
                            continue  # zombie not yet reaped
                except (OSError, IndexError):
                    continue
                out.append(int(name))
        return out

    def _kill_all(self):
        """kill(-1): every process of the namespace except R dies (only as PID 1)."""
        for _ in range(100):
            try:
                os.kill(-1, signal.SIGKILL)
            except ProcessLookupError:
                pass
            while True:
                try:
                    os.waitpid(-1, 0)
                except ChildProcessError:
                    break
                except InterruptedError:
                    continue
            if not self._strays():
                break
        self.zpid = None
        if self.zsock is not None:
            self.zsock.close()
            self.zsock = None

    # one job
    def run_job(self, job):
        """Run one job in fresh worker(s) forked by the zygote; return the reply dict."""
        opts = self.opts
        timeout = float(job.get("timeout") or 2.0)
        limit = int(opts["output_limit"])
        payload_limit = int(opts.get("payload_limit", 1 << 22))
        tail = int(opts.get("tail_bytes", 4096))
        oom_before = _oom_count()
        if self.zpid is None:
            try:
                self.spawn_zygote()
            except Exception as exc:  # before the job ran: not its doing, the host retries it elsewhere
                return {"id": job.get("id"), "fatal": "zygote did not start: %s: %s" % (type(exc).__name__, exc),
                        "anomaly": "runner error", "infra": True}
        t0 = time.monotonic()
        reply = {"id": job.get("id"), "exit": None, "signal": None, "timed_out": False,
                 "output_limit": False, "oom": False, "anomaly": None}
        self.workers, self.exits, self.feed = {}, {}, None
        pipes = self._dispatch(job, timeout, reply)
        if pipes is None:
            return reply
        readers = {pipes[0][0]: _Tail(tail), pipes[1][0]: _Tail(tail), pipes[2][0]: _Tail(payload_limit)}
        open_fds = set(readers)
        dead = self._pump(readers, open_fds, pipes, t0 + timeout, reply)
        status, t_exit = self.exits.get(self.workers.get("P"), (None, None))
        if status is None or dead:
            t_exit = time.monotonic()
            status = self._stop_worker("P")
            if status is None:
                reply["anomaly"] = reply["anomaly"] or "worker status lost"
        if "C" in self.workers:
            self._stop_worker("C")  # a tests job's callee ends with its tester
        self._close_feed()
        _drain(readers, open_fds, 4 * max(limit, payload_limit))
        for r, _ in pipes:
            os.close(r)
        if status is not None and status >= 0 and not dead:
            if os.WIFSIGNALED(status):
                reply["signal"] = os.WTERMSIG(status)
            elif os.WIFEXITED(status):
                reply["exit"] = os.WEXITSTATUS(status)
        out, err, res = (readers[p[0]] for p in pipes)
        if out.total + err.total > limit:
            reply["output_limit"] = True
        reply["stdout"], reply["stderr"] = out.text(), err.text()
        reply["stdout_bytes"], reply["stderr_bytes"] = out.total, err.total
        reply["payload"] = bytes(res.buf).decode("utf-8", "replace") if res.total <= payload_limit else None
        reply["run_s"] = (t_exit or time.monotonic()) - t0
        self._clean_up(reply)
        oom_after = _oom_count()
        reply["oom"] = oom_before >= 0 and oom_after > oom_before
        return reply

    def _dispatch(self, job, timeout, reply):
        """Hand the job and the write ends of three fresh pipes (stdout, stderr, results) to the
        zygote; for a tests job also the tester's end of a socket on which R alone sends the tests
        (``self.feed``: never through the zygote, so the callee cannot find them in its memory).
        Returns the pipes, or None (with ``reply["anomaly"]`` set) if the zygote is gone."""
        pipes = [os.pipe() for _ in range(3)]
        mode = job.get("mode", "exec")
        body = json.dumps({"mode": mode, "program": job.get("program", ""), "entry": job.get("entry", ""),
                           "args": job.get("args", []), "timeout": timeout}).encode()
        send = [w for _, w in pipes]
        theirs = None
        if mode == "tests":
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            spec = {"tests": job.get("tests"), "context": job.get("context"), "entry": job.get("entry")}
            self.feed = [ours, bytearray(json.dumps(spec).encode())]
            send.append(theirs.fileno())
        try:
            socket.send_fds(self.zsock, [struct.pack("<Q", len(body))], send)
            self.zsock.sendall(body)
        except OSError as exc:
            for r, _ in pipes:
                os.close(r)
            reply["anomaly"] = "zygote unreachable: %s" % exc
            self._close_feed()
            self._kill_all()
            return None
        finally:
            for _, w in pipes:
                os.close(w)
            if theirs is not None:
                theirs.close()
        return pipes

    def _note(self, msgs):
        """Record the zygote's messages: worker pids by kind, exit statuses with their time."""
        for kind, pid, st in msgs:
            if kind == "X":
                self.exits[pid] = (st, time.monotonic())
            else:
                self.workers[kind] = pid

    def _feed_some(self):
        """Send the next chunk of a tests job's spec to the tester, without blocking."""
        sock, pending = self.feed
        try:
            n = sock.send(pending[:_READ], socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL)
        except BlockingIOError:
            return
        except OSError:
            n = len(pending)  # the tester is gone: its verdict is missing, a failure
        del pending[:n]
        if not pending:
            self._close_feed()

    def _close_feed(self):
        if self.feed is not None:
            self.feed[0].close()
            self.feed = None

    def _pump(self, readers, open_fds, pipes, deadline, reply):
        """Read the worker's pipes and the zygote's messages (and feed a tester) until the exit
        status of the worker that ends the job arrives, the deadline passes or an output limit is
        crossed. Returns True when the zygote died."""
        limit = int(self.opts["output_limit"])
        payload_limit = readers[pipes[2][0]].keep
        zfd = self.zsock.fileno()
        while self.workers.get("P") not in self.exits:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                reply["timed_out"] = True
                return False
            feed = [self.feed[0]] if self.feed is not None else []
            try:
                ready, writable, _ = select.select(list(open_fds) + [zfd], feed, [], remaining)
            except InterruptedError:
                continue
            if writable:
                self._feed_some()
            for fd in ready:
                if fd == zfd:
                    msgs = self._recv_zmsgs()
                    if msgs is None:
                        reply["anomaly"] = "zygote died"
                        return True
                    self._note(msgs)
                    continue
                data = os.read(fd, _READ)
                if not data:
                    open_fds.discard(fd)
                else:
                    readers[fd].add(data)
            if readers[pipes[0][0]].total + readers[pipes[1][0]].total > limit:
                reply["output_limit"] = True
                return False
            if readers[pipes[2][0]].total > payload_limit:
                reply["output_limit"] = True
                return False
        return False

    def _stop_worker(self, kind):
        """SIGKILL the worker of ``kind`` (``P`` or ``C``) and its process group, then collect its
        exit status from the zygote (at most 2 s). Returns the status, or None if it was lost."""
        killed = None
        end = time.monotonic() + 2.0
        while True:
            pid = self.workers.get(kind)
            if pid in self.exits:
                return self.exits[pid][0]
            if pid and pid != killed:
                for target in (-pid, pid):
                    try:
                        os.kill(target, signal.SIGKILL)
                    except OSError:
                        pass
                killed = pid
            if self.zsock is None or time.monotonic() >= end:
                return None
            ready, _, _ = select.select([self.zsock.fileno()], [], [], max(0.0, end - time.monotonic()))
            msgs = self._recv_zmsgs() if ready else None
            if msgs is None:
                return None
            self._note(msgs)

    def _clean_up(self, reply):
        """Leave a clean state for the next job: reap, kill every stray process of the namespace
        (an anomaly: the host retires the sandbox), wipe the writable folders."""
        self._reap()
        if self.pid1:
            strays = self._strays()
            if strays or self.zpid is None:
                if strays:
                    reply["anomaly"] = reply["anomaly"] or "%d process(es) outlived the job" % len(strays)
                self._kill_all()
        for path in self.opts.get("wipe", []):
            if not _wipe(path):
                reply["anomaly"] = reply["anomaly"] or "could not wipe %s" % path

    def serve(self):
        stdin = sys.stdin.buffer
        self.spawn_zygote()
        _send_line({"ready": True, "pid1": self.pid1, "uid": os.getuid(),
                    "python": sys.version.split()[0]})
        while True:
            line = stdin.readline()
            if not line:
                return
            try:
                job = json.loads(line)
            except ValueError:
                _send_line({"fatal": "bad job line"})
                continue
            try:
                reply = self.run_job(job)
            except Exception as exc:  # report, never die silently
                reply = {"id": job.get("id"), "fatal": "%s: %s" % (type(exc).__name__, exc),
                         "anomaly": "runner error"}
            _send_line(reply)


def oneshot_main(opts, job_text=None):
    """Run one job (JSON on stdin) in a forked worker of this fresh process; print the reply.

    The no-pool baseline: a new sandbox per job pays start-up, this one job, and teardown.
    """
    job = json.loads(job_text if job_text is not None else sys.stdin.buffer.read())
    if job.get("mode") == "tests":
        _send_line({"id": job.get("id"), "fatal": "tests jobs need a warm runner (--runner)"})
        return
    job["timeout"] = float(job.get("timeout") or 2.0)
    tail = int(opts.get("tail_bytes", 4096))
    pipes = [os.pipe() for _ in range(3)]
    t0 = time.monotonic()
    pid = os.fork()
    if pid == 0:
        for r, _ in pipes:
            os.close(r)
        _worker_main(job, [w for _, w in pipes], opts)
    for _, w in pipes:
        os.close(w)
    tails = {pipes[0][0]: _Tail(tail), pipes[1][0]: _Tail(tail),
             pipes[2][0]: _Tail(int(opts.get("payload_limit", 1 << 22)))}
    open_fds = set(tails)
    deadline = t0 + job["timeout"]
    reply = {"id": job.get("id"), "exit": None, "signal": None, "timed_out": False,
             "output_limit": False, "oom": False, "anomaly": None}
    status = None
    while status is None:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            reply["timed_out"] = True
            break
        ready, _, _ = select.select(list(open_fds), [], [], min(remaining, 0.05)) if open_fds else \
            (time.sleep(min(remaining, 0.005)) or [], [], [])
        for fd in ready:
            data = os.read(fd, _READ)
            if data:
                tails[fd].add(data)
            else:
                open_fds.discard(fd)
        if tails[pipes[0][0]].total + tails[pipes[1][0]].total > int(opts["output_limit"]):
            reply["output_limit"] = True
            break
        if not open_fds or not ready:
            done, st = os.waitpid(pid, os.WNOHANG)
            if done:
                status = st
    if status is None:
        for target in (-pid, pid):
            try:
                os.kill(target, signal.SIGKILL)
            except OSError:
                pass
        _, status = os.waitpid(pid, 0)
    reply["run_s"] = time.monotonic() - t0
    if os.WIFSIGNALED(status):
        reply["signal"] = os.WTERMSIG(status)
    elif os.WIFEXITED(status):
        reply["exit"] = os.WEXITSTATUS(status)
    out, err, res = (tails[p[0]] for p in pipes)
    reply["stdout"], reply["stderr"] = out.text(), err.text()
    reply["payload"] = bytes(res.buf).decode("utf-8", "replace")
    _send_line(reply)


def _set_signals(handler):
    """Set every catchable signal but SIGCHLD to ``handler`` (``SIG_IGN`` or ``SIG_DFL``).

    R ignores them all: the job runs as R's uid and may ``kill(1, sig)`` with any signal. Inside a
    PID namespace the kernel drops signals to its init that the init leaves at ``SIG_DFL``, but a
    Python process has a handler for SIGINT (KeyboardInterrupt), and the ``unsafe_local`` runtime
    has no namespace at all. SIGCHLD stays at its default: ignoring it would make the kernel reap
    R's children itself and lose the exit statuses R waits for. A write to a stdout the host closed
    still ends R (``BrokenPipeError``). R's children get ``SIG_DFL`` back before they exec.
    """
    for sig in signal.valid_signals():
        if sig in (signal.SIGKILL, signal.SIGSTOP, signal.SIGCHLD):
            continue
        try:
            signal.signal(sig, handler)
        except (OSError, ValueError):  # numbers libc reserves for itself (32, 33) cannot be set
            pass


def main(argv):
    mode = argv[2] if len(argv) > 2 else "--runner"
    if mode == "--zygote":
        zygote_main(int(argv[3]), json.loads(argv[4]))
    elif mode == "--oneshot":
        oneshot_main(json.loads(argv[3]), argv[4] if len(argv) > 4 else None)
    else:
        _nondumpable()
        _set_signals(signal.SIG_IGN)
        os.chdir("/")
        Runner(argv[1], json.loads(argv[3])).serve()


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[0] == "-c":
    main(sys.argv)
