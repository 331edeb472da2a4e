#!/usr/bin/env bash
# Session 48: on an H200, device_c.sh (issue 34's grids against book/data/*_h200.json, issue 38's
# Gluon run); on any other GPU (the stored grids are the H200's) device_h100.sh (issue 38's Gluon
# run, issue 37's host split, GPU tests). From the repository root, OUT set.
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
    SKIP_GLUON=${SKIP_GLUON:-1} bash perf/runs/s48/device_c.sh
else
    bash perf/runs/s48/device_h100.sh
fi
