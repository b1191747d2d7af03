"""``python -m collector_processor`` runs the collector (same as ``otel-straggler-collector``)."""

import sys

from collector_processor.entry import main

sys.exit(main())
