"""What a merge records: one result type for both kinds (a composite, and an average, which
carries more), so that ``merge`` returns one type. Its own module: averaging subclasses it, and
merge dispatches to averaging."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class MergeResult:
    manifest: int
    tag: str
    step: int  # the base's step, which the result resumes at
    sources: dict[str, int] = field(default_factory=dict)  # a composite's layer -> the step whose blobs it uses
    named: dict[str, str] = field(default_factory=dict)  # layer -> the source the spec named (a composite)
    seconds: float = 0.0
    id: str = "-"  # the manifest's name on every host
