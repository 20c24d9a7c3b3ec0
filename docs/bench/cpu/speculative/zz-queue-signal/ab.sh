# /tmp/ab3/new holds `git archive a329d10 worker mlxq schemas producer` (the worker tells a full engine whether
# jobs wait; the bench's in-process arms say none do), /tmp/ab3/old the same of 7345263 (a full engine takes
# it that requests wait). 8 rows on the arms' 8 slots, both workloads, greedy and sampled, 3 repeats each.
M=$(/work/main/.venv/bin/mlxq real-model)
for v in new old; do
  out=/tmp/ab3/OUT/$v-$(date +%H%M%S)
  (cd /tmp && PYTHONPATH=/tmp/ab3/$v timeout 1500 /work/main/.venv/bin/python -m mlxq bench --model "$M" --scenario speculative --spec-in-process --spec-rows 8 --spec-drafters ngram,control --spec-workloads grounded,chat --spec-sampling greedy,sampled --spec-new-tokens 128 --repeats 3 --out $out > $out.log 2>&1)
  echo "$v $out:"; grep '| 8 |' $out/table.md
done
