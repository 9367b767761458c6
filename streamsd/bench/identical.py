"""`streamsd bench offline --check-identical`: whether greedy output depends on the batch or on speculation.

Plain passes run the same prompts at every batch size (the first b of one list), so each plain cell
counts the requests whose tokens equal those of the same prompts at the smallest batch; each
speculative cell counts the requests whose tokens equal its batch's plain pass. With `--exact` every
count should be whole (the batch-invariant forward, EngineConfig.exact); without it a count short of
the requests shows how far bf16 reductions that change with the batch move greedy output.
"""

from __future__ import annotations

from typing import Any


def identical(a: list[list[int]], b: list[list[int]]) -> int:
    """Requests (in order, over the shorter list) whose tokens are the same in both."""
    return sum(x == y for x, y in zip(a, b, strict=False))


def batch_invariance(outputs: list[list[int]], first: tuple[int, list[list[int]]] | None) -> dict[str, Any]:
    """A plain cell's fields: its requests identical to the same prompts' at the smallest batch `first`."""
    if first is None:
        return {}
    b0, ref = first
    n = min(len(outputs), len(ref))
    return {"identical_to_smallest_batch": f"{identical(outputs, ref)}/{n}", "smallest_batch": b0}


def problems(cells: list[dict[str, Any]]) -> list[str]:
    """One line per streamsd cell whose output differs: a plain one from the smallest batch's, a
    speculative one from its batch's plain pass."""
    out = []
    for c in cells:
        if c.get("engine") != "streamsd":
            continue
        for key in ("identical_to_smallest_batch", "identical_to_plain"):
            same, _, n = str(c.get(key, "")).partition("/")
            if n and same != n:
                out.append(f"{c['method']} at batch {c['batch']}: {key} {same} of {n} requests")
    return out


def report(cells: list[dict[str, Any]]) -> int:
    """Print the check's verdict; 0 when every cell's output is identical, 1 otherwise."""
    bad = problems(cells)
    checked = sum(1 for c in cells if c.get("engine") == "streamsd"
                  and ("identical_to_smallest_batch" in c or "identical_to_plain" in c))
    if bad:
        print(f"check-identical: {len(bad)} of {checked} compared cells differ:")
        for line in bad:
            print(f"  {line}")
        return 1
    print(f"check-identical: all {checked} compared cells are token-identical")
    return 0
