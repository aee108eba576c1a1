// Validates Kubernetes objects against their CRDs' published schemas (the kubernetes-models
// packages): reads a JSON array of objects on stdin, writes one JSON line per object,
// {"kind", "name", "error"} (error null when valid; "no schema" for a kind not known here).
import { HTTPRoute } from "@kubernetes-models/gateway-api/gateway.networking.k8s.io/v1/HTTPRoute";
import { PrometheusRule } from "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1/PrometheusRule";
import { ServiceMonitor } from "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1/ServiceMonitor";

const MODELS = {
  "gateway.networking.k8s.io/v1 HTTPRoute": HTTPRoute,
  "monitoring.coreos.com/v1 PrometheusRule": PrometheusRule,
  "monitoring.coreos.com/v1 ServiceMonitor": ServiceMonitor,
};

function check(object) {
  const Model = MODELS[`${object.apiVersion} ${object.kind}`];
  if (!Model) return "no schema";
  try {
    new Model(object).validate();
    return null;
  } catch (error) {
    return String(error.message);
  }
}

let input = "";
for await (const chunk of process.stdin) input += chunk;
for (const object of JSON.parse(input)) {
  const name = object.metadata?.name ?? null;
  process.stdout.write(JSON.stringify({ kind: object.kind, name, error: check(object) }) + "\n");
}
