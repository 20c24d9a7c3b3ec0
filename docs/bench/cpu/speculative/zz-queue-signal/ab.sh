# /tmp/ab3/new holds `git archive a329d10 worker mlxq schemas producer` (the worker tells a full engine whether
# jobs wait; the bench's in-process arms say none do), /tmp/ab3/old the same of 7345263 (a full engine takes
# it that requests wait). 8 rows on the arms' 8 slots, both workloads, greedy and sampled, 3 repeats each.
bash "$(dirname "$0")/../ab_trees.sh" /tmp/ab3
