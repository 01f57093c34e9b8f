"""What an object store's refusal of its options or credentials means, in words that name the fix.

s3fs hands the options it does not name to botocore's session, which refuses a misspelt one only
when the first call makes its client ("AioSession.__init__() got an unexpected keyword argument
'endpointurl'"), and a machine without credentials surfaces as botocore's NoCredentialsError:
neither says which field to fix, and retrying cannot help either.

Protocol: a command that opens a store for the user calls `open_now(storage)` before its first call
(the client is made at once, without a request; a refused option raises there), and whoever
catches a storage error asks `explain(error, field)` for the sentence, None when it is neither. A
filesystem that does not start at all is described by `cannot_start`, every error named in one
line by `error_reason`.
"""

from __future__ import annotations

import difflib
import inspect
import re

_UNEXPECTED = re.compile(r"unexpected keyword argument '([^']+)'")


def _taken(fs_class) -> list[str]:
    """The option names `fs_class` takes by name (its constructor's, and s3fs's session's `profile`)."""
    names = [p.name for p in inspect.signature(fs_class.__init__).parameters.values()
             if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name != "self"]
    return names + (["profile"] if "s3" in getattr(fs_class, "protocol", ()) else [])


def explain(error: BaseException, field: str, fs_class=None) -> str | None:
    """The sentence for an option the filesystem does not take or for missing credentials, naming
    `field` (e.g. `checkpoint.storage_options`, `--storage-option`); None for any other error."""
    match = _UNEXPECTED.search(str(error)) if isinstance(error, TypeError) else None
    if match:
        name = match.group(1)
        near = difflib.get_close_matches(name, _taken(fs_class), n=1) if fs_class is not None else []
        hint = f"did you mean {near[0]!r}?" if near else "remove it"
        return f"{field}: {name!r} is not an option this store takes; {hint}"
    if type(error).__name__ == "NoCredentialsError":
        return (f"no credentials for the object store: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or a "
                f"profile) in the environment, or key and secret in {field} through a storage options file")
    return None


def error_reason(err: BaseException, limit: int = 200) -> str:
    """`Type: message` on one line, at most `limit` characters: how every command names a storage error."""
    text = " ".join(f"{type(err).__name__}: {err}".split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def cannot_start(url: str, with_options: bool, err: BaseException) -> str:
    """Why the filesystem of `url` did not start, and the fix: its options when it was given some
    (the caller names their field), else its client libraries and set-up (the URL's field)."""
    if with_options:
        return f"cannot open {url} with these options ({error_reason(err)}); fix or remove the offending option"
    return f"{url}: its filesystem did not start ({error_reason(err)}); check its client libraries and setup"


def open_now(storage) -> None:
    """Make an object store's client now (no request is sent): an option it refuses raises here,
    before the first call, instead of inside it. Local and in-memory stores have nothing to make."""
    if storage.is_s3:
        storage.fs.connect()
