#!/usr/bin/env bash
# Session 53: on an H200, session 48's device_c.sh (issue 34's grids against the book's
# *_h200.json files, issue 38's Gluon keys, the decode grid); on any other GPU, device_ab.sh
# (issue 34's attention grid, this tree against 98758ef on the same machine). Root, OUT set.
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
    SKIP_GLUON=${SKIP_GLUON:-0} bash perf/runs/s48/device_c.sh
else
    bash perf/runs/s53/device_ab.sh
fi
