"""The block-kernel contract, below every other layer: the static
configuration (``config``), the runtime mask operands (``mask``), the
primitives that dispatch one block to a backend (``kernel``), the backend
registry (``registry``), argument checks (``validate``; ``ints``, the
integer checks below both it and ``config``) and shard_map's varying-axes
bookkeeping (``vma``). Nothing here imports a backend, a strategy or
anything above them."""
