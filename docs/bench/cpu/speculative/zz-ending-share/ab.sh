# Run from anywhere: /tmp/ab/old holds `git archive 4069371 worker mlxq schemas producer`, /tmp/ab/new the same of 270856f.
M=$(/work/main/.venv/bin/mlxq real-model)
for v in new old; do
  out=/tmp/ab/OUT/$v-$(date +%H%M%S)
  (cd /tmp && PYTHONPATH=/tmp/ab/$v timeout 1500 /work/main/.venv/bin/python -m mlxq bench --model "$M" --scenario speculative --spec-in-process --spec-rows 8 --spec-drafters ngram,control --spec-workloads grounded,chat --spec-sampling greedy,sampled --spec-new-tokens 128 --repeats 3 --out $out > $out.log 2>&1)
  echo "$v $out:"; grep '| 8 |' $out/table.md
done
