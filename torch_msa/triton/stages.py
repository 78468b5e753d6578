"""The Triton stages other backends compose with their own kernels: the public interface of this
package's kernel modules, which are otherwise private to it.

The stages run on the Triton kernels, so they belong to this package; a backend that composes
them (the SM90 backend: its forward's partials are merged, its backward's delta computed and its
deterministic backward reduced and finished here) needs triton, and says so in its requirements.
Nothing here chooses a backend: each backward is written out as its own sequence of stages.

Both:

* `bucket_key_count`: the keys of each bucket's block inside its document, which the SM90
  kernels read beside a plan (`torch_msa.schedule.bucket_key_count` in one kernel).

Forward:

* `combine`: merge the per-(query, slot) partial outputs of a KV-outer forward into `out` and
  `lse`.

Backward (`dS = P (dP - delta)` needs `delta` first; the key pass is each backend's own):

* `compute_delta`: `delta = rowsum(dO * O) - grad_lse`, fp32.
* `ungroup_dq`: dQ in natural order and the inputs' dtype from an accumulator whose blocks of
  heads group the dims (the SM90 backward's `[D / 8, 16 heads, 8]`).
* `key_workspace` (a `KeyWorkspace`): the schedule of a deterministic backward and the per-item
  dK/dV slots its key pass stores into;
* `reduce_key_workspace`: the slots summed per key in a fixed (item) order, into dK/dV;
* `query_dq`: dQ, query-outer, every element with one owner;
* `deterministic_begin` and `deterministic_finish` (`deterministic_stages.py`): all of those but the
  key pass, in order, around a backend's own key pass.

The Triton deterministic backward is delta, the Triton key pass, the reduction and dQ
(`backward_deterministic.py`); the SM90 one is the same with the SM90 key pass
(`torch_msa/sm90/backward_deterministic.py`), so the two differ only in the per-item dK/dV
their key passes store.

Importing this module imports triton.
"""

from .backward_deterministic_kernel import KeyWorkspace, key_workspace, query_dq, reduce_key_workspace
from .backward_kernel import compute_delta, ungroup_dq
from .deterministic_stages import DeterministicBackward
from .deterministic_stages import begin as deterministic_begin
from .deterministic_stages import finish as deterministic_finish
from .forward_kernel import combine
from .plan_kernel import bucket_key_count

__all__ = ["DeterministicBackward", "KeyWorkspace", "bucket_key_count", "combine", "compute_delta",
           "deterministic_begin", "deterministic_finish", "key_workspace", "query_dq", "reduce_key_workspace", "ungroup_dq"]
