"""analysis: metrics, confidence intervals and checks written once against qsim's record schema."""
