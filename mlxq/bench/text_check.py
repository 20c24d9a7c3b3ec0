"""Whether every arm wrote the same text for the same greedy request.

The reference is the first request of each workload run alone through mlx-lm's `generate_step`
(greedy) on the bench's own copy of the model, before the arms run. Each arm's output for every
request is kept (token ids where the arm has them: A, B, K, S, C; the streamed text where it has
only text: D, E), and the report says per arm and repeat whether that request's text equals the
reference's, and for how many requests it equals the agreement arm's (B where it ran).

EOS: A, B, K, S and C ignore it (an EOS token is emitted and decoding goes on), D and E mask it
(the next best token is taken), so their texts can only agree up to the first EOS a greedy decode
meets. Texts are compared up to there: an output with token ids is cut at its first EOS; a text-only
output must then begin with the other's text, or equal it where no EOS came (a leading space aside:
mlx_lm.server's streaming detokenizer drops the first token's).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Optional

from mlxq.bench.workloads import RequestRecord, Workload

REFERENCE = ("the first request of each workload alone through mlx-lm's generate_step (greedy) in the bench's "
             "process; compared up to the first EOS, which D and E mask and the others emit and decode past, "
             "and a text-only arm's (D, E) leading space aside")


@dataclass(frozen=True)
class Output:
    """One request's greedy text up to its first EOS. `ended_at_eos`: whether an EOS came within
    max_tokens (None for a text-only arm, which masks EOS and cannot tell)."""

    text: str
    ended_at_eos: Optional[bool]

    def to_json(self) -> dict[str, Any]:
        return {"text": self.text, "ended_at_eos": self.ended_at_eos}


def from_token_ids(token_ids: Iterable[int], tokenizer: Any, eos: set[int]) -> Output:
    ids = [int(t) for t in token_ids]
    cut = next((i for i, t in enumerate(ids) if t in eos), None)
    return Output(_clean(tokenizer.decode(ids if cut is None else ids[:cut])), cut is not None)


def from_record(record: RequestRecord, tokenizer: Any, eos: set[int]) -> Optional[Output]:
    """What an arm kept of a request's output (`token_ids` or `text` in its extra), if anything."""
    if record.error is not None:
        return None
    if record.extra.get("token_ids") is not None:
        return from_token_ids(record.extra["token_ids"], tokenizer, eos)
    if record.extra.get("text") is not None:
        return Output(_clean(str(record.extra["text"])), None)
    return None


def _clean(text: str) -> str:
    # A decode cut inside a multi-byte character ends in U+FFFD; a streaming detokenizer holds it back.
    return text.rstrip("\ufffd")


def agree(a: Output, b: Output) -> bool:
    if a.ended_at_eos is not None and b.ended_at_eos is not None:
        return a == b
    known, text_only = (a, b) if a.ended_at_eos is not None else (b, a)
    # mlx-lm's streaming detokenizer (mlx_lm.server's) drops the first token's leading space.
    known_text, other_text = known.text.lstrip(" "), text_only.text.lstrip(" ")
    if known.ended_at_eos:
        return other_text.startswith(known_text)
    return other_text == known_text


def reference_outputs(model: Any, tokenizer: Any, workloads: Iterable[Workload]) -> dict[str, Output]:
    """{workload label: its first request's greedy output alone}, through mlx-lm's generate_step."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    eos = {int(t) for t in tokenizer.eos_token_ids}
    found: dict[str, Output] = {}
    for workload in workloads:
        first = min(workload.requests, key=lambda r: r.index)
        ids = [int(token) for token, _ in generate_step(mx.array(list(first.prompt.ids)), model,
                                                          max_tokens=first.max_tokens)]
        found[workload.label] = from_token_ids(ids, tokenizer, eos)
    return found


class TextCheck:
    """Collects each arm's outputs as the runs end and reports their agreement."""

    def __init__(self, tokenizer: Any, references: dict[str, Output], eos: Optional[set[int]] = None) -> None:
        self.tokenizer = tokenizer
        self.eos = eos if eos is not None else {int(t) for t in getattr(tokenizer, "eos_token_ids", ())}
        self.references = references
        # (arm, workload label, repeat) -> {request index: output}
        self.outputs: dict[tuple[str, str, int], dict[int, Optional[Output]]] = {}

    def add(self, arm: str, workload: Workload, repeat: int, records: list[RequestRecord]) -> None:
        self.outputs[(arm, workload.label, repeat)] = {r.index: from_record(r, self.tokenizer, self.eos)
                                                       for r in records}

    def report(self) -> dict[str, Any]:
        arms = list(dict.fromkeys(arm for arm, _, _ in self.outputs))
        agreement_arm = "B" if "B" in arms else (arms[0] if arms else None)
        workloads: dict[str, Any] = {}
        for label in dict.fromkeys(label for _, label, _ in self.outputs):
            reference = self.references.get(label)
            entry: dict[str, Any] = {"reference": reference.to_json() if reference else None, "arms": {}}
            for arm in arms:
                repeats = sorted(r for a, w, r in self.outputs if a == arm and w == label)
                if not repeats:
                    continue
                same, with_agreement, compared = [], [], []
                for repeat in repeats:
                    outputs = self.outputs[(arm, label, repeat)]
                    first = outputs.get(min(outputs)) if outputs else None
                    same.append(None if reference is None or first is None else agree(first, reference))
                    theirs = self.outputs.get((agreement_arm, label, repeat), {}) if agreement_arm else {}
                    pairs = [(o, t) for i, o in outputs.items() if o is not None and (t := theirs.get(i)) is not None]
                    with_agreement.append(sum(agree(o, t) for o, t in pairs))
                    compared.append(len(pairs))
                # A request either arm lost (failed, no output) is not compared.
                arm_entry: dict[str, Any] = {"same_as_reference": same, f"requests_same_as_{agreement_arm}":
                                             with_agreement, "requests_compared": compared,
                                             "requests": len(self.outputs[(arm, label, repeats[0])])}
                differs = [o for r in repeats if (o := self._first(arm, label, r)) is not None and reference
                           and not agree(o, reference)]
                if differs:
                    arm_entry["first_text_differing"] = differs[0].to_json()
                entry["arms"][arm] = arm_entry
            workloads[label] = entry
        checked = [v for w in workloads.values() for a in w["arms"].values() for v in a["same_as_reference"]]
        return {"reference": REFERENCE, "agreement_arm": agreement_arm, "workloads": workloads,
                "all_same_as_reference": bool(checked) and all(v is True for v in checked)}

    def _first(self, arm: str, label: str, repeat: int) -> Optional[Output]:
        outputs = self.outputs.get((arm, label, repeat)) or {}
        return outputs.get(min(outputs)) if outputs else None


def identity_lines(section: dict[str, Any]) -> list[str]:
    """The table's lines: per workload and arm, the reference check for each repeat and the
    requests that agree with the agreement arm."""
    agreement = section.get("agreement_arm")
    lines = ["### Greedy text", "", f"Reference: {section['reference']}.", "",
             f"| workload | arm | first request = mlx-lm alone | requests = {agreement}'s text (of those both wrote) |",
             "| --- | --- | --- | --- |"]
    for label, entry in section["workloads"].items():
        for arm, a in entry["arms"].items():
            same = ", ".join({True: "yes", False: "NO", None: "—"}[v] for v in a["same_as_reference"])
            count = ", ".join(f"{n}/{m}" + (f" ({a['requests'] - m} not compared: failed)" if m < a["requests"] else "")
                              for n, m in zip(a[f"requests_same_as_{agreement}"], a["requests_compared"]))
            lines.append(f"| {label} | {arm} | {same} | {count} |")
    lines.append("")
    return lines
