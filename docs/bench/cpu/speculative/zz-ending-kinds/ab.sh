# /tmp/ab4/new holds `git archive 32ca749 worker mlxq schemas producer` (the share of rows ending early learnt
# for each kind of row), /tmp/ab4/old the same of 191815a (one share for all rows). 8 rows on the arms' 8
# slots, both workloads (their batches alternate on each arm's engine), greedy and sampled, 3 repeats each.
bash "$(dirname "$0")/../ab_trees.sh" /tmp/ab4
