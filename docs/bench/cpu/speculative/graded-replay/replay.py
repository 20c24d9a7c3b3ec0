"""Replay the recorded greedy answers (record.py) against prompt lookup and the speculation policies.

1. Per match length: how many of prompt lookup's proposals of 4 tokens the answers bear out.
2. Each policy's decisions, step by step, for batches of 1 and 8 rows of the recorded answers: a row
   in a pass keeps its proposal as far as it equals its answer (what verification of a greedy row
   does) plus one token; a decode step makes one token a row. A pass of width w costs COST[w] decode
   steps (measured at 8 slots on the 2-core CPU, docs/performance.md); the figure is the batch's
   decode steps without speculation over its cost with it (prefill left out). The graded policy
   also as a worker sees the costs: each width's known once it has run 3 passes, before that the
   prior of 2 ("widths learnt, prior") or, below a measured width, its share of that one's extra cost
   ("widths learnt, shares", as the engine does since it was added).
3. Closed batches (no request waits for a slot) of 8, the answers in 24 orders (the first as
   recorded, the others shuffled), the share of rows ending early learnt over an order's batches as a
   worker learns it (graded.py's EarlyEndings), on a new worker and on one that served the order's
   batches once before and so knows how they end (the bench's workers learn it from their warm-up
   and the repeats before): grounded batches alone, chat batches alone, and the two alternating on
   one worker (as the bench's runs of both workloads do). Over the answers recorded here (float32 on
   the CPU) and on an H200 (chat-h200-bf16.json and grounded-h200-bf16.json: record.py's answers from
   the bf16 copy through mlx-lm on the H200), at the CPU's costs, at the costs an H100 learnt
   (docs/bench/h100/speculative/dec05-f-learnt-costs, rounded up), and deciding at the costs an H200
   learnt from its call windows while paying 1.3 steps a pass (what its greedy chat passes cost by
   wall time, docs/performance.md).

Run from the repository: .venv/bin/python docs/bench/cpu/speculative/graded-replay/replay.py
"""
import json, random, sys
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[4]))
import worker.engines.speculation.graded as graded
from worker.engines.speculation import AdaptiveSpeculator, GradedSpeculator
from worker.engines.speculation.ngram import NgramDrafter, _RowIndex

HERE = Path(__file__).parent
COST = {1: 1.0, 2: 1.23, 3: 1.61, 4: 1.86, 5: 2.38}
H100_COST = {1: 1.0, 2: 1.1, 3: 1.15, 4: 1.2, 5: 1.2}


def by_match_length(answers, k=4):
    stats = defaultdict(lambda: [0, 0, 0, 0])  # proposals, proposed, accepted, none accepted
    for row in answers:
        prompt, out, t, index = row["prompt"], row["output"], 1, _RowIndex(3)
        while t < len(out):
            index.extend(prompt + out[:t])
            draft = index.propose(k)[: len(out) - t - 1]
            kept = next((i for i, (a, b) in enumerate(zip(draft, out[t:])) if a != b), len(draft))
            if draft:
                s = stats[index.matched]
                s[0], s[1], s[2], s[3] = s[0] + 1, s[1] + len(draft), s[2] + kept, s[3] + (kept == 0)
            t += kept + 1
    return {n: s for n, s in sorted(stats.items(), reverse=True)}


class Row:
    def __init__(self, uid, answer):
        self.spec = SimpleNamespace(uid=uid, speculative=True, max_tokens=128, sampling=SimpleNamespace(
            temperature=0.0, repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0))
        self.prompt, self.out, self.generated, self.constraint = answer["prompt"], answer["output"], answer["output"][:1], None


def known(runs):
    """Every width's cost known from the start."""
    return lambda slot_count, width: COST[width]


def learnt(below_measured):
    """A width's cost known once 3 of its passes ran (`runs`: passes per width so far, kept across
    batches as a worker keeps them), the prior of 2 before; with `below_measured`, a width below a
    measured one takes its share of that one's extra cost (worker/engines/speculation/pass_cost.py)."""
    def cost_of(runs):
        def cost(slot_count, width):
            measured = sorted(w for w, n in runs.items() if n >= 3 and w >= width)
            if width in measured:
                return COST[width]
            if not below_measured or not measured:
                return 2.0
            return min(2.0, 1 + (COST[measured[0]] - 1) * (width - 1) / (measured[0] - 1))
        return cost
    return cost_of


def replay(answers, make, slots=8, costs=known, runs=None, endings=None):
    speculator = make()
    runs = {} if runs is None else runs
    if endings is not None:  # what the worker learnt of the batches before
        speculator.endings = endings
    speculator.costs.cost = costs(runs)
    rows = [Row(f"r{i}", a) for i, a in enumerate(answers)]
    cost, live = 0.0, [r for r in rows if len(r.generated) < len(r.out)]
    while live:
        speculator.step_began(live, slots)
        plan = speculator.plan(live, slots) if speculator.wants(live, slots) else None
        drafts = {id(p.seq): p.draft for p in plan.rows} if plan else {}
        cost += COST[plan.width] if plan else 1
        if plan:
            runs[plan.width] = runs.get(plan.width, 0) + 1
        for r in live:
            g, draft = len(r.generated), drafts.get(id(r), [])
            kept = next((i for i, (a, b) in enumerate(zip(draft, r.out[g:])) if a != b), min(len(draft), len(r.out) - g))
            if draft:
                speculator.outcome(r, len(draft), kept)
            r.generated = r.out[: g + kept + 1]
            if len(r.generated) >= len(r.out):
                speculator.ended(r)
        live = [r for r in live if len(r.generated) < len(r.out)]
    return max(len(a["output"]) for a in answers) - 1, cost


def ratio(answers, make, size, costs=known):
    steps = cost = 0
    runs, endings = {}, graded.EarlyEndings()
    for start in range(0, len(answers), size):
        s, c = replay(answers[start:start + size], make, costs=costs, runs=runs, endings=endings)
        steps, cost = steps + s, cost + c
    return steps / cost


def closed_batches(answers, make, paid=None, warm=False, orders=24, size=8):
    """Each kind's batches (alternating: grounded and chat batches in turn on one worker) in `orders`
    orders; per kind, decode steps over cost and the passes a batch. A pass costs COST[width], or
    `paid` where given. `warm`: the worker served the order's batches once before (not counted)."""
    steps, cost, passes, batches = defaultdict(float), defaultdict(float), defaultdict(int), defaultdict(int)
    for order in range(orders):
        shuffled = {kind: rows[:] for kind, rows in answers.items()}
        if order:
            for n, rows in enumerate(shuffled.values()):
                random.Random(order + 100 * n).shuffle(rows)
        for kinds in (["grounded"], ["chat"], ["grounded", "chat"]):
            label = "alternating: " if len(kinds) > 1 else ""
            speculator, endings = make(), graded.EarlyEndings()
            starts = range(0, min(len(rows) for rows in shuffled.values()), size)
            for counted, start in [(False, start) for start in starts if warm] + [(True, start) for start in starts]:
                for kind in kinds:
                    runs = {}
                    s, c = replay(shuffled[kind][start:start + size], lambda: speculator, runs=runs, endings=endings)
                    if paid is not None:
                        c += sum(n * (paid - COST[width]) for width, n in runs.items())
                    if not counted:
                        continue
                    steps[label + kind] += s
                    cost[label + kind] += c
                    passes[label + kind] += sum(runs.values())
                    batches[label + kind] += 1
    return {kind: (steps[kind] / cost[kind], passes[kind] / batches[kind]) for kind in steps}


def print_closed_batches(make):
    saved = dict(COST)
    recorded = {source: {kind: json.loads((HERE / f"{kind}{suffix}.json").read_text()) for kind in ("grounded", "chat")}
                for source, suffix in (("CPU", ""), ("H200", "-h200-bf16"))}
    costs = {"CPU costs": (saved, None), "H100 costs": (H100_COST, None),
             "H200 learnt, 1.3 paid": ({1: 1.0, 2: 1.1, 3: 1.1, 4: 1.12, 5: 1.1}, 1.3)}
    for source, answers in recorded.items():
        for label, (table, paid) in costs.items():
            COST.clear(), COST.update(table)
            for warm in (False, True):
                found = closed_batches(answers, make, paid, warm)
                print(f"{source} answers, {label}, {'a worker that served them before' if warm else 'a new worker'}: "
                      + "  ".join(f"{kind} {ratio_:.3f} ({passes:.1f})" for kind, (ratio_, passes) in found.items()),
                      flush=True)
    COST.clear(), COST.update(saved)


if __name__ == "__main__":
    answers = {kind: json.loads((HERE / f"{kind}.json").read_text()) for kind in ("grounded", "chat")}
    print("prompt lookup's proposals of 4 tokens on the grounded answers, by the match they continue:")
    for n, (count, proposed, accepted, none) in by_match_length(answers["grounded"]).items():
        print(f"  match of {n}: {count} proposals, {accepted / proposed:.0%} of tokens accepted, "
              f"{accepted / count:.2f} a proposal, none accepted {none / count:.0%}")
    policies = {"adaptive": lambda: AdaptiveSpeculator(NgramDrafter(), pass_cost=2.0, measure_cost=True),
                "graded": lambda: GradedSpeculator(NgramDrafter(), pass_cost=2.0, measure_cost=True)}
    for kind in ("grounded", "chat"):
        for size in (1, 8):
            for name, make in policies.items():
                print(f"{kind:8s} {size} row(s) {name:24s} {ratio(answers[kind], make, size):.3f}")
            graded.BATCH_MARGIN = 1.0
            plain = ratio(answers[kind], policies["graded"], size)
            graded.BATCH_MARGIN = 2.0
            print(f"{kind:8s} {size} row(s) {'graded, margin 1':24s} {plain:.3f}")
            for label, costs in (("widths learnt, prior", learnt(False)), ("widths learnt, shares", learnt(True))):
                print(f"{kind:8s} {size} row(s) {'graded, ' + label:24s} {ratio(answers[kind], policies['graded'], size, costs):.3f}")
    print("closed batches of 8 in 24 orders (decode steps over cost, passes a batch in brackets):")
    print_closed_batches(policies["graded"])
