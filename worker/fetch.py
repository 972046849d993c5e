"""A model snapshot from the Hugging Face Hub, fetched by a pod's init container.

The files go into a Hugging Face cache (``cache_dir``): on a claim it is shared by the pods
of a pool and kept between them, and its files are stored by content, so two revisions share
what they have in common and concurrent downloads of the same file take turns. The snapshot
of the commit the revision resolves to then appears at ``link``, a symbolic link in the
pod's own emptyDir, which the engine loads with ``HF_HUB_OFFLINE=1``. The link is the pod's:
a pod loads the commit its own init container fetched, even while pods of a newer revision
fill the same cache.

The token comes from ``HF_TOKEN`` (huggingface_hub reads it there) and appears in no
message: a failure is one line that names the repository, the revision and what to check.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path


class FetchError(ValueError):
    """A snapshot that could not be fetched, with the reason (and what to check) in the
    message."""


def fetch_model(
    repo: str,
    revision: str,
    link: str | Path,
    *,
    cache_dir: str | Path | None = None,
    include: Sequence[str] = (),
    exclude: Sequence[str] = (),
) -> Path:
    """Fetch ``repo`` at ``revision`` (only the files matching ``include``, if given, and
    none matching ``exclude``) and point ``link`` at it. Returns the snapshot directory."""
    from huggingface_hub import snapshot_download

    try:
        path = snapshot_download(
            repo,
            revision=revision,
            cache_dir=str(cache_dir) if cache_dir is not None else None,
            allow_patterns=list(include) or None,
            ignore_patterns=list(exclude) or None,
        )
    except Exception as exc:  # huggingface_hub's errors, explained in one line
        raise FetchError(_scrub(explain(exc, repo, revision))) from None
    snapshot = Path(path)
    try:
        _point(Path(link), snapshot)
    except OSError as exc:
        raise FetchError(f"cannot link {link} to {snapshot}: {exc.strerror or exc}") from None
    return snapshot


def _point(link: Path, target: Path) -> None:
    """Make ``link`` a symbolic link to ``target``, replacing an older one atomically (an
    init container that runs again, after a restart of its pod, finds its link there)."""
    link.parent.mkdir(parents=True, exist_ok=True)
    tmp = link.with_name(f".{link.name}.tmp")
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(target, target_is_directory=True)
    os.replace(tmp, link)


def explain(exc: Exception, repo: str, revision: str) -> str:
    """What went wrong, and what to check, for an error of ``snapshot_download``."""
    from huggingface_hub import constants
    from huggingface_hub.utils import (  # where 0.x, 1.x and 2.x all have them
        GatedRepoError,
        HfHubHTTPError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    where = f"{repo} at revision {revision!r}"
    if os.environ.get("HF_TOKEN"):
        unreadable = "the token in HF_TOKEN may not read it"
    else:
        unreadable = "no token was given (HF_TOKEN is unset)"
    status = getattr(getattr(exc, "response", None), "status_code", None)
    if isinstance(exc, RevisionNotFoundError):
        return f"{where}: no such revision in {repo} (give a branch, a tag or a commit sha)"
    if isinstance(exc, GatedRepoError):
        return (
            f"{where}: the repository is gated and {unreadable}; accept its terms on"
            f" {constants.ENDPOINT}/{repo} with the account whose token the Secret holds"
        )
    if isinstance(exc, RepositoryNotFoundError):
        return (
            f"{where}: repository not found (HTTP {status}): it does not exist, or it is"
            f" private or gated and {unreadable}"
        )
    if isinstance(exc, HfHubHTTPError):
        if status == 401:
            return f"{where}: the Hub refused the token in HF_TOKEN (HTTP 401: invalid or expired)"
        if status == 403:
            return f"{where}: the token in HF_TOKEN may not read this repository (HTTP 403)"
        return f"{where}: the Hub at {constants.ENDPOINT} answered HTTP {status}"
    if isinstance(exc, HFValidationError):
        return f"{where}: {exc}"
    if isinstance(exc, LocalEntryNotFoundError):  # no Hub reachable, nothing in the cache
        cause = exc.__cause__ or exc
        return f"{where}: cannot reach the Hub at {constants.ENDPOINT} ({_first_line(cause)})"
    if isinstance(exc, OSError):
        return f"{where}: cannot write the snapshot ({exc.strerror or _first_line(exc)})"
    return f"{where}: {type(exc).__name__}: {_first_line(exc)}"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _scrub(message: str) -> str:
    """No message carries the token, whatever a library put in it."""
    token = os.environ.get("HF_TOKEN")
    return message.replace(token, "***") if token else message
