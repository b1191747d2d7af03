"""A span-stream simulator for a Megatron job, with labelled faults, to measure detection quality (tests and
benches only: not in the wheel; importable from the checkout root).

``job`` lays out ranks and cohorts, ``faults`` describes what is injected, ``stream`` produces the
OTLP requests the emitter would send (one per step), ``score`` compares verdicts with the labels, ``load``
builds pre-encoded SDK-sized requests fast for the throughput and scale benches.
"""
