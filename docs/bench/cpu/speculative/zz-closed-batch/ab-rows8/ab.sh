M=$(/work/main/.venv/bin/mlxq real-model)
for v in old new old new; do
  src=/work/main; [ $v = old ] && src=.old (git archive 877419e)
  out=OUT/$v-$(date +%H%M%S)
  (cd /tmp && PYTHONPATH=$src timeout 1500 /work/main/.venv/bin/python -m mlxq bench --model "$M" --scenario speculative --spec-in-process --spec-rows 8 --spec-drafters ngram,control --spec-workloads grounded,chat --spec-sampling greedy --spec-new-tokens 128 --repeats 3 --out $out > $out.log 2>&1)
  echo "$v $out:"; grep '| greedy | 8' $out/table.md
done
