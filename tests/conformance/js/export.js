// Replays a training job (tests/conformance/straggler_job.py, as JSON) through the OpenTelemetry JavaScript SDK:
// every process's spans are made by the SDK's tracer (its resource, scopes, ids by the trace-id rule of
// docs/schema.md, given through an IdGenerator) and sent by one of the SDK's OTLP trace exporters.
//
//   node export.js <job.json> <grpc|proto|json> <gzip|none> <endpoint>
//
// Prints one JSON line: each export's result code (0 success, 1 failed) and error, and every diagnostic warning
// the exporters logged (a partial success is logged there).
'use strict';

const fs = require('fs');
const api = require('@opentelemetry/api');
const { resourceFromAttributes } = require('@opentelemetry/resources');
const {
  BasicTracerProvider, InMemorySpanExporter, SimpleSpanProcessor,
} = require('@opentelemetry/sdk-trace-base');

const EXPORTERS = {
  grpc: () => require('@opentelemetry/exporter-trace-otlp-grpc').OTLPTraceExporter,
  proto: () => require('@opentelemetry/exporter-trace-otlp-proto').OTLPTraceExporter,
  json: () => require('@opentelemetry/exporter-trace-otlp-http').OTLPTraceExporter,
};

class GivenIds {
  constructor() { this.trace = ''; this.span = ''; }
  generateTraceId() { return this.trace; }
  generateSpanId() { return this.span; }
}

function hrTime(ns) {
  const n = BigInt(ns);
  return [Number(n / 1000000000n), Number(n % 1000000000n)];
}

async function main() {
  const [jobPath, kind, compression, endpoint] = process.argv.slice(2);
  const job = JSON.parse(fs.readFileSync(jobPath, 'utf8'));
  const warnings = [];
  const log = (...args) => warnings.push(args.map(String).join(' '));
  api.diag.setLogger({ error: log, warn: log, info() {}, debug() {}, verbose() {} }, api.DiagLogLevel.WARN);
  const Exporter = EXPORTERS[kind]();
  const exporter = new Exporter({ url: endpoint, compression, timeoutMillis: 10000 });
  const results = [];
  for (const batch of job) {
    const ids = new GivenIds();
    const memory = new InMemorySpanExporter();
    const provider = new BasicTracerProvider({
      resource: resourceFromAttributes(batch.resource),
      idGenerator: ids,
      spanProcessors: [new SimpleSpanProcessor(memory)],
    });
    for (const sp of batch.spans) {
      const tracer = provider.getTracer(sp.scope, '0.1.0');
      let ctx = api.ROOT_CONTEXT;
      if (sp.parent_span_id) {
        ctx = api.trace.setSpanContext(ctx, {
          traceId: sp.trace_id, spanId: sp.parent_span_id, traceFlags: api.TraceFlags.SAMPLED, isRemote: true,
        });
      }
      ids.trace = sp.trace_id;
      ids.span = sp.span_id;
      const span = tracer.startSpan(sp.name, {
        kind: api.SpanKind.INTERNAL, attributes: sp.attributes, startTime: hrTime(sp.start_ns),
      }, ctx);
      span.end(hrTime(sp.end_ns));
    }
    await provider.forceFlush();
    const spans = memory.getFinishedSpans();
    const result = await new Promise((resolve) => exporter.export(spans, resolve));
    const error = result.error ? `${result.error}${result.error.data ? ': ' + result.error.data : ''}` : null;
    results.push({ code: result.code, error, spans: spans.length });
    await provider.shutdown();
  }
  await exporter.shutdown();
  process.stdout.write(JSON.stringify({ results, warnings }) + '\n');
}

main().catch((e) => {
  process.stderr.write(String(e && e.stack ? e.stack : e) + '\n');
  process.exit(2);
});
