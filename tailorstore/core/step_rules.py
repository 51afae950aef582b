"""Pure rules about steps that every verb applies: what a tag may be, and what a thinned step
cannot do. They live below the verbs so that ingest and restore apply them without reaching
sideways into curate (the layer rule of tests/system/test_layers.py)."""

from __future__ import annotations

from tailorstore.core.errors import Call, StoreError, ThinnedStepError

TAG_BYTES = 72  # escaped (=XX a byte outside [A-Za-z0-9._-]), with a temp file's suffix: under 255 bytes


def check_tag(tag: str) -> str:
    """A tag names an object key (``refs/tags/<tag>``) and a line of the log: no separators, no
    control characters, not a path's ``.`` or ``..``, and not a number (``step=N`` is one)."""
    if (
        not tag
        or tag.isdigit()
        or tag in (".", "..")
        or tag != tag.strip()
        or any(c in "=/\\" or ord(c) < 32 or ord(c) == 127 or 0xD800 <= ord(c) < 0xE000 for c in tag)
        or len(tag.encode()) > TAG_BYTES  # after the surrogates (undecodable bytes of argv) are out
    ):
        raise StoreError(
            f"tag {tag!r} is not allowed: use up to {TAG_BYTES} bytes of letters, digits, '-', '_' or '.' "
            "(not only digits, not . or ..)."
        )
    return tag


def refuse_thinned(step: int, tier: str | None, what: str) -> None:
    """Checkout of a thinned step would write a checkpoint that cannot resume: say so, write nothing."""
    if tier is not None:
        raise ThinnedStepError(
            f"step {step} was thinned to {tier} by gc: it holds no optimizer state, "
            f"so {what} cannot resume training from it. ",
            Call("export", f"step={step}", out="DIR"),
            " writes its weights as safetensors; an averaging merge reads it too.",
        )
