"""The processes of a parameter-server job's actors, as the report and the chaos checks name them.

Protocol (the supervisor's thread, paramserver.supervisor): `note(kind, index, pid)` whenever an
actor's pid is seen (its first answer, each step log, each progress poll). The mapping itself is
every process the job started, by label ("worker 1", then "worker 1 #2" for its replacement);
`live` is the process each server and worker index has now.
"""

from __future__ import annotations


class ActorPids(dict):
    def __init__(self) -> None:
        super().__init__()
        self.live: dict[tuple[str, int], int] = {}

    def note(self, kind: str, index: int, pid: int) -> None:
        self.live[(kind, index)] = pid
        if pid not in self.values():
            name = f"{kind} {index}"
            same = sum(label == name or label.startswith(f"{name} #") for label in self)
            self[name + (f" #{same + 1}" if same else "")] = pid
