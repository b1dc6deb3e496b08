"""KernelModule: the part every module with a bound C kernel shares (SparseFFN, Predictor,
DenseLinear).

A bound kernel reads its tensors through raw pointers taken when `select_kernel()` ran, so:
- a dtype or device change (.half(), .float(), .to(...), .cuda(): nn.Module._apply) selects the
  kernel again for the new tensors, or `_check_movable` refuses the change;
- pickling (torch.save of a model) leaves the kernel, a ctypes closure, out and selects it again
  on unpickling.
- a tensor whose storage was swapped (`.data = ...`, load_state_dict(assign=True)) is seen by
  comparing `_ptrs()` with the pointers recorded when the kernel was set (`rebind_if_moved`:
  the modules' forward where it is cheap, and the whole-step decoder before every use).
Subclasses set `self.kernel` and `self._selected = True` in their `select_kernel()`. Each
setting of `kernel` gets a new `kernel_generation` (unique in the process): what holds the
kernel's pointers elsewhere (the whole-step decoder) compares it, not id(kernel), which a new
kernel object may reuse."""

from __future__ import annotations

import itertools

from torch import nn

_generations = itertools.count(1)


class KernelModule(nn.Module):
    kernel_generation = 0  # changes whenever `kernel` is set
    _BOUND = ("_kernel",)  # attributes holding kernels bound to raw pointers (not pickled)

    @property
    def kernel(self):
        """The bound kernel, or None (the reference path)."""
        return self.__dict__.get("_kernel")

    @kernel.setter
    def kernel(self, value) -> None:
        self.__dict__["_kernel"] = value
        self.__dict__["kernel_generation"] = next(_generations)
        self.__dict__["_bound"] = self._ptrs()  # the storage its raw pointers were taken from

    def select_kernel(self) -> str:  # pragma: no cover - every subclass defines it
        raise NotImplementedError

    def _ptrs(self) -> tuple:
        """Where the module's own tensors are now (None for an absent one)."""
        return tuple(None if t is None else t.data_ptr()
                     for t in (*self._parameters.values(), *self._buffers.values()))

    def rebind_if_moved(self) -> bool:
        """Select the kernel again if a tensor's storage was swapped since it was bound.
        -> whether it was."""
        if self.kernel is None or self._ptrs() == self.__dict__.get("_bound"):
            return False
        self.select_kernel()
        return True

    def _check_movable(self) -> None:
        """Raise where the module's tensors may not change dtype or device."""

    def _was_selected(self) -> bool:
        return self.kernel is not None or bool(self.__dict__.get("_selected"))

    def _apply(self, fn, recurse=True):
        self._check_movable()
        out = super()._apply(fn, recurse)
        if self._was_selected():
            self.select_kernel()
        return out

    def __getstate__(self):
        state = self.__dict__.copy()
        for name in self._BOUND:
            state[name] = None
        state["_bound"] = None
        state["_had_kernel"] = self._was_selected()
        return state

    def __setstate__(self, state):
        had_kernel = state.pop("_had_kernel", False)
        self.__dict__.update(state)
        if had_kernel:
            self.select_kernel()
