"""The demo application (``otel-straggler demo``): rank processes, one slowed, and the collector finding it.

An application, not a library: it imports the emitter (``otel_straggler``) and the collector
(``collector_processor``, the ``collector`` extra); no library package imports it.
"""
