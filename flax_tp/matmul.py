"""The dense layers' local matmul, with its kernel gradient in the form XLA:CPU runs fast.

A dense layer's kernel gradient contracts the token axes of its input and of the
output's cotangent: ``dkernel [in, out] = x [T, in]^T @ dy [T, out]``. JAX emits
it as ``dot(dy, x)`` and a transpose; XLA folds the transpose into the dot, which
then contracts dimension 0 of both row-major operands. XLA:CPU runs that form as
a plain Eigen dot, while dots whose operands are ``[M, K] x [K, N]`` go to its
faster XNNPACK kernels. Under GSPMD a data-parallel all-reduce happens to sit
between the dot and the transpose, so the partitioned model keeps the canonical
``dy^T [out, T] @ x [T, in]``, and XLA lays ``dy^T`` out as one transposed copy.
Inside ``shard_map`` (and on one device) nothing sits there, and every kernel
gradient of a step took the slow path (BENCHMARKS.md §2).

``dense_matmul`` gives the same values as ``jax.lax.dot_general`` and differs
only in how its derivative is written on CPU: the kernel gradient is computed as
``(dy^T @ x)^T``, the form GSPMD's step runs, with optimization barriers that
keep XLA from folding either transpose back into the dot.
"""

from __future__ import annotations

import functools
from typing import Any

import jax

Array = jax.Array


def dense_matmul(x: Array, kernel: Array, *, precision: Any = None,
                 preferred_element_type: Any = None, cpu_gradient: bool = False) -> Array:
  """``x [..., in] @ kernel [in, out]`` -> ``[..., out]``, both on this device.

  ``cpu_gradient``: write the kernel gradient as XLA:CPU's canonical dot
  ``dy^T [out, T] @ x [T, in]``, transposed after (see the module docstring).
  The forward and both derivatives are the same functions either way,
  forward-mode autodiff included; the kernel gradient may differ in the last
  bits (another summation order). It costs one transposed copy of ``dy`` per
  kernel gradient, as GSPMD's step pays. Off on other backends, whose matmuls
  read transposed operands natively. ``preferred_element_type``: the output's
  (and accumulation's) dtype, as ``jax.lax.dot_general`` takes it.
  """
  if cpu_gradient:
    return _cpu_matmul(precision, preferred_element_type)(x, kernel)
  return _dot(x, kernel, precision, preferred_element_type)


def _dot(x: Array, kernel: Array, precision: Any, preferred_element_type: Any = None) -> Array:
  return jax.lax.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())),
                             precision=precision, preferred_element_type=preferred_element_type)


@functools.cache
def _cpu_matmul(precision: Any, preferred_element_type: Any):
  """``_dot`` with its JVP written so that its transpose, the kernel gradient,
  is ``(dy^T @ x)^T`` with ``dy^T`` materialised."""
  barrier = jax.lax.optimization_barrier

  @jax.custom_jvp
  def matmul(x, kernel):
    return _dot(x, kernel, precision, preferred_element_type)

  @matmul.defjvp
  def matmul_jvp(primals, tangents):
    x, kernel = primals
    dx, dkernel = tangents
    x_2d = x.reshape(-1, x.shape[-1])  # [T, in]
    # The kernel's tangent term as ((dkernel^T [out, in]) @ x^T)^T. Transposed
    # for the backward pass, each step reverses: dy [T, out] -> dy^T [out, T]
    # (the inner barrier keeps it a copy), dy^T @ x [out, in] (canonical), then
    # its transpose (the outer barrier keeps XLA from folding it into the dot).
    dy_kernel = barrier(jax.lax.dot_general(barrier(dkernel.T), x_2d, (((1,), (1,)), ((), ())),
                                            precision=precision,
                                            preferred_element_type=preferred_element_type)).T
    dy = (_dot(dx, kernel, precision, preferred_element_type)
          + dy_kernel.reshape(*x.shape[:-1], kernel.shape[1]))
    return _dot(x, kernel, precision, preferred_element_type), dy

  return matmul
