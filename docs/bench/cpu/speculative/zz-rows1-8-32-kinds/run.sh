# The code of 09c23ed (each kind of row's own share of early endings; the worker tells its engine whether jobs
# wait), the real model at 1, 8 and 32 rows in one process, greedy, the floor (a random draft) and a control
# beside prompt lookup, 3 interleaved repeats, on the 2-core CPU otherwise idle. From the checkout's root.
out=/tmp/rows1-8-32
rm -rf $out
(cd /tmp && timeout 2400 /work/main/.venv/bin/mlxq bench --model "$(/work/main/.venv/bin/mlxq real-model)" \
  --scenario speculative --spec-in-process --spec-rows 1,8,32 --spec-drafters ngram,draft-random,control \
  --spec-workloads grounded,chat --spec-sampling greedy --spec-new-tokens 128 --repeats 3 --out $out > $out.log 2>&1)
echo "exit $?"
