"""The name stored skeletons give :class:`TensorSlot`: ``tailorstore.atoms.TensorSlot``.

Part of the on-disk format (docs/FORMAT.md, 3.2), so it outlives the module's move to
``tailorstore.core.atom_types``. Nothing else belongs here.
"""

from tailorstore.core.atom_types import TensorSlot

__all__ = ["TensorSlot"]
