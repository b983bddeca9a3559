# The APIs this configuration and the workloads use. Left enabled on destroy: other things in the
# project may depend on them.
locals {
  services = [
    "artifactregistry.googleapis.com",     # the images' repository (artifact_registry.tf)
    "bigquery.googleapis.com",             # the producer's queries
    "cloudresourcemanager.googleapis.com", # project IAM bindings, the project's number
    "cloudscheduler.googleapis.com",       # the producer's schedule
    "compute.googleapis.com",              # Private Service Access address, Direct VPC egress
    "iam.googleapis.com",                  # service accounts
    "logging.googleapis.com",              # the producer's logs-based lag metric
    "monitoring.googleapis.com",           # the producer alert policy
    "pubsub.googleapis.com",               # topics
    "run.googleapis.com",                  # the producer job
    "secretmanager.googleapis.com",        # the streams file
    "servicenetworking.googleapis.com",    # Private Service Access
    "sqladmin.googleapis.com",             # Cloud SQL; also called by the Auth Proxies
  ]
}

resource "google_project_service" "enabled" {
  # Identity-Aware Proxy only for the console (console_enabled); Cloud Trace's OTLP endpoint
  # (the Telemetry API) and Cloud Trace only with tracing_enabled.
  for_each = toset(concat(
    local.services,
    var.console_enabled ? ["iap.googleapis.com"] : [],
    var.tracing_enabled ? ["telemetry.googleapis.com", "cloudtrace.googleapis.com"] : [],
  ))

  project = var.project_id
  service = each.value
  # The default since provider 7.0; spelled out, since a destroy that disabled an API would break
  # everything else in the project that uses it.
  disable_on_destroy = false
}
