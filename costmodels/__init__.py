"""Tracing a model into a measured layer graph, and the cost models that price it on hardware."""
