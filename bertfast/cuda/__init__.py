"""The CUDA C++ backend: one validating wrapper module per op over the torch-free launchers in
``bertfast._C`` (csrc/), with the names and signatures of the op's launcher contract
(``bertfast.ops.<op>`` documents it; the Triton launchers in ``bertfast.kernels.<op>`` share it).

Each wrapper
  1. validates every tensor (CUDA device, dtype, shape, strides, alignment where a kernel needs
     it) with bertfast.contract's checks and raises ValueError naming what was expected and what
     was given, before any GPU work;
  2. allocates outputs and workspaces with torch (the caching allocator);
  3. calls bertfast._C with data_ptr()s and the current stream under the tensors' device
     (``_common.launch``); a failing launcher raises RuntimeError with its message.
No autograd here (bertfast.ops wires it). ``_common`` holds the extension and what the wrappers
share; ``unsupported(inputs)`` in each module declares the op's limits on this backend.
"""
