#!/bin/bash
# interleaved A/B: before = 1ecf2b8 (/work/wt-before), after = main HEAD; resnet50, 2 ranks, deepfreeze, 3 reps each run
PY=/work/main/.venv/bin/python
for round in 1 2; do
  for tree in before after; do
    if [ $tree = before ]; then D=/work/wt-before; else D=/work/main; fi
    (cd $D && timeout 900 $PY -m experiments.torch_dcp --models resnet50 --ranks 2 --busy none --reps 3 \
        --approaches deepfreeze --out /work/measure/i45/ab_resnet_${tree}_${round}.json > /work/measure/i45/ab_resnet_${tree}_${round}.log 2>&1)
  done
done
echo done > /work/measure/i45/ab_resnet.done
