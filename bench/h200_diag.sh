#!/usr/bin/env bash
# Diagnostics for the argument-error crash seen in run 4 (test_layer_ops: segfault at the first
# ValueError from _C.rms_norm on CUDA tensors). Writes $OUT/diag.log.
OUT=${OUT:?set OUT}
{
echo "== v1: _C.rms_norm on fake CUDA views (no kernel)"
timeout 60 python3 -X faulthandler -c "
from pagedllm import _C
V=_C.TensorView
x=V(4096,'float32',[3,8],[8,1],'cuda',0); o=V(8192,'float32',[3,8],[8,1],'cuda',0); w=V(16384,'float32',[7],[1],'cuda',0)
try: _C.rms_norm(o,x,w,1e-5,0)
except Exception as e: print('v1 ok', type(e).__name__, e)
"; echo "rc=$?"
echo "== v2: reshape_and_cache argument error on CUDA tensors"
timeout 60 python3 -X faulthandler -c "
import torch, pagedllm.ops as ops
k=torch.zeros(3,2,64,device='cuda'); kc=torch.zeros(4,2,16,64,device='cuda')
try: ops.reshape_and_cache(k,k,kc,kc.clone(),torch.zeros(3,dtype=torch.int32,device='cuda'))
except Exception as e: print('v2 ok', type(e).__name__, e)
try: ops.rms_norm(torch.empty(3,8,device='cuda'), torch.randn(3,8,device='cuda'), torch.ones(7,device='cuda'), 1e-5)
except Exception as e: print('v3 ok', type(e).__name__, e)
"; echo "rc=$?"
echo "== gdb"
timeout 90 cuda-gdb -batch -ex "set pagination off" -ex "handle SIGPIPE nostop noprint" -ex run -ex "bt 40" \
  --args python3 -m pytest tests/python/test_layer_ops.py -k bad_arguments -m cuda -q -p no:cacheprovider 2>&1 | \
  grep -vE "^\[(New|Thread|Detaching)|^warning:" | tail -80
} > "$OUT/diag.log" 2>&1
