#!/bin/bash
# Alternating A/B: base (5f58523) vs this branch, quickstart 60 steps, same machine state.
OUT=/work/wt/overhead/runs/ab
mkdir -p $OUT
for i in 1 2; do
  for side in base branch; do
    if [ $side = base ]; then TREE=/tmp/base; else TREE=/work/wt/overhead; fi
    echo "$(date +%H:%M:%S) $side run$i load $(cut -d' ' -f1-3 /proc/loadavg)" >> $OUT/ab.log
    (cd $TREE && PYTHONPATH=$TREE timeout 900 /work/wt/overhead/.venv/bin/python -m beamrl.cli train recipes/quickstart.yaml run.num_steps=60 run.output_dir=$OUT/$side$i --overwrite > $OUT/$side$i.log 2>&1)
    echo "$(date +%H:%M:%S) $side run$i done rc $? load $(cut -d' ' -f1-3 /proc/loadavg)" >> $OUT/ab.log
  done
done
