"""picompile: compile a PyTorch / Hugging Face causal LM into activation-sparse FFNs.

    cm = picompile.compile(model)            # exact mode: lossless for ReLU models
    cm.generate(input_ids, max_new_tokens=32)
    print(picompile.explain(cm))
    picompile.serve(cm, tokenizer)           # an OpenAI-compatible server on 127.0.0.1:8000
    picompile.export_onnx(cm, "model.onnx")  # the rewritten graphs, to look at in Netron
"""

from picompile.compiled_model import CompiledModel
from picompile.compiler import compile, load
from picompile.explain import explain
# The function: picompile.export_onnx(cm, path). Importing it needs no onnx; calling it does.
from picompile.export_onnx import export_onnx
# The function: picompile.serve(cm, tokenizer, ...) (the module's other names: `from
# picompile.serve import make_app`). Importing it needs no FastAPI; calling it does.
from picompile.serve import serve

__all__ = ["compile", "explain", "load", "CompiledModel", "serve", "export_onnx"]
__version__ = "0.1.0"
