# /tmp/ab4/new holds `git archive 32ca749 worker mlxq schemas producer` (the share of rows ending early learnt
# for each kind of row), /tmp/ab4/old the same of 191815a (one share for all rows). 8 rows on the arms' 8
# slots, both workloads (their batches alternate on each arm's engine), greedy and sampled, 3 repeats each.
M=$(/work/main/.venv/bin/mlxq real-model)
for v in new old; do
  out=/tmp/ab4/OUT/$v-$(date +%H%M%S)
  (cd /tmp && PYTHONPATH=/tmp/ab4/$v timeout 1500 /work/main/.venv/bin/python -m mlxq bench --model "$M" --scenario speculative --spec-in-process --spec-rows 8 --spec-drafters ngram,control --spec-workloads grounded,chat --spec-sampling greedy,sampled --spec-new-tokens 128 --repeats 3 --out $out > $out.log 2>&1)
  echo "$v $out:"; grep '| 8 |' $out/table.md
done
