"""The gradient side: reduction during backward (``grad_reducers``: stage 1 keeps full
gradients, stages 2-3 keep a reduced shard), mixed precision and fp16 loss scaling
(``precision``), the global-norm clip and loss-scale divisor (``clip``) and the non-finite
gradient policy (``nonfinite``)."""
