"""The opt-in CPU weight formats behind the one CPU knob, `--quantization` (SGLang keeps its formats
in `layers/quantization/` the same way): `quantization.py` resolves the option and loads a model in
its format; `fp16.py` (fbgemm's fp16 matmuls), `int8.py` (int8 kernels and modules), `int8_file.py`
(the int8 cache file), `calibration.py` (the prefill that sizes int8's smoothing), `ops.py` (direct
calls into torch's packed-weight ops). The float32 path is the models' own (`models/linear.py`)."""
