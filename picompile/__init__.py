"""picompile: compile a PyTorch / Hugging Face causal LM into activation-sparse FFNs.

    cm = picompile.compile(model)            # exact mode: lossless for ReLU models
    cm.generate(input_ids, max_new_tokens=32)
    print(picompile.explain(cm))
"""

from picompile.compiler import CompiledModel, compile, explain, load

__all__ = ["compile", "explain", "load", "CompiledModel"]
__version__ = "0.1.0"
