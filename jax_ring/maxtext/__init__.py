"""jax_ring inside MaxText: its attention, with nothing to write.

::

  import jax_ring.maxtext
  jax_ring.maxtext.install()      # every AttentionOp jax_ring serves
  ...                             # MaxText's own trainer, model, config
  jax_ring.maxtext.uninstall()    # MaxText's own attention again

or ``with jax_ring.maxtext.installed(): ...``, or from the shell
``python -m jax_ring.maxtext.train [--strategy S] base.yml key=value ...``
(MaxText's trainer, installed). Needs MaxText (``pip install
"jax-ring[maxtext]"``); tested against MaxText 0.2.5.

Everything jax_ring needs is read from MaxText's config and each call:
the pre-scaled query (scale 1), causal or full attention, the sliding
window, the soft cap, sinks, GQA/MQA, packed segment ids (0 included, as
MaxText's ``dot_product`` attends), the mesh axis the sequence is sharded
over, and the order MaxText's input pipeline left the batch in
(``context_parallel_load_balance``, ``context_parallel_reorder_strategy``).
The table is in ``jax_ring.maxtext._read``. Decode, prefill, paged and ragged
attention, chunked prefill, bidirectional, indexer and compressed masks,
chunked, block-diffusion and absorbed-MLA attention, quantized KV caches
and ``record_max_logits`` run MaxText's own code, each reason logged once
(logger ``jax_ring.maxtext``). A config it cannot read unambiguously is a
``ValueError`` naming the key.
"""

from jax_ring.maxtext._patch import install, installed, uninstall

__all__ = ["install", "installed", "uninstall"]
