"""Typed errors of weight sync.

Every error names the version (and, where one is involved, the tensor and the store object that
failed: ``key``) so a log line is enough to find the broken object. ``retryable`` says whether trying again can help (a missing object may be
a garbage-collected version: retrying from a newer keyframe helps; a checksum mismatch on the same
bytes does not).
"""

from __future__ import annotations

from infra.errors import DeltaloopError


class WeightSyncError(DeltaloopError):
    """Base class of every weight-sync failure."""

    retryable = False

    def __init__(self, message: str, version: int | None = None, tensor: str | None = None,
                 key: str | None = None) -> None:
        where = []
        if version is not None:
            where.append(f"version {version}")
        if tensor is not None:
            where.append(f"tensor {tensor!r}")
        if key is not None:
            where.append(f"object {key}")
        prefix = (", ".join(where) + ": ") if where else ""
        super().__init__(prefix + message)
        self.detail = message
        self.version = version
        self.tensor = tensor
        self.key = key

    def at(self, key: str) -> "WeightSyncError":
        """This error naming the store object ``key`` (itself if it already names one): for errors
        raised where the object was not known, such as a manifest's parser."""
        if self.key is not None:
            return self
        return type(self)(self.detail, self.version, self.tensor, key)


class VersionNotFound(WeightSyncError):
    """No committed version (manifest) matches the request."""

    retryable = True


class MissingObject(WeightSyncError):
    """A data object named by a committed manifest is gone (collected or lost)."""

    retryable = True


class CorruptData(WeightSyncError):
    """A frame failed to decode or its checksum did not match (truncated or corrupted bytes)."""


class WrongBase(WeightSyncError):
    """A delta was about to be applied to tensors that are not the version it was made against."""


class IncompatibleTensors(WeightSyncError):
    """Tensor names, shapes or dtypes differ from what the operation expects."""


class ManifestError(WeightSyncError):
    """A manifest could not be read or has an unknown format."""
