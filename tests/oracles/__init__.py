"""Python references of the compiled loops: production runs the compiled ones, tests hold
them equal to these."""
