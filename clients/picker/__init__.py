"""``kvindex picker``: a Gateway API Inference Extension endpoint picker over Envoy ext_proc."""
