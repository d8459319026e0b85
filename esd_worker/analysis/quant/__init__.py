"""Quantized weights as float weights, by scheme family (issue 41).

plan: what every family shares (a Plan per logical weight, the stored tensors grouped by
module, the checkpoint's quantization_config, the unpacking and scale-grid arithmetic);
scaled: float8 and int8 weights with their scales (FP8 per tensor, channel, group and block,
bitsandbytes int8, compressed-tensors int8); packed: integers packed into int32 words
(GPTQ, AWQ, compressed-tensors pack-quantized); bnb4: bitsandbytes nf4/fp4; fp4: MXFP4
(GPT-OSS) and NVFP4; view: the Tensors over a checkpoint that reads each quantized weight
dequantized. The entry point is esd_worker.analysis.quantized.dequantized.
"""
