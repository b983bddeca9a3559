# The dispatcher's alert rules (deploy/k8s/alerts.yaml, a Google Managed Prometheus `Rules`
# resource) as the parts of Cloud Monitoring alert policies with PromQL conditions, so the
# expressions have one source: the file the cluster also applies. No provider and no resource
# here, only data: ../pubsub-outbox/monitoring.tf makes the policies, and deploy/check evaluates this module
# offline (`terraform console`) to check that every paging alert has a policy that notifies.
#
# Cloud Monitoring evaluates PromQL over every cluster and namespace of the project, where the
# Rules resource sees only its own: every selector's job="pubsub-outbox-dispatcher" matcher (each
# has one: deploy/check) becomes job, project_id, cluster and namespace matchers.

variable "rules_file" {
  description = "Path of deploy/k8s/alerts.yaml."
  type        = string
}

variable "project_id" {
  description = "Project of the GKE cluster (the project_id label of its Managed Prometheus series)."
  type        = string
}

variable "cluster" {
  description = "Name of the GKE cluster the dispatcher runs in (the cluster label)."
  type        = string
}

variable "namespace" {
  description = "Namespace of the dispatcher (the namespace label)."
  type        = string
}

variable "enabled" {
  description = "Give the alerts (the pubsub-outbox module's alerts_enabled): false, both outputs are empty and no policy is made."
  type        = bool
}

locals {
  # The PodMonitoring's name (deploy/k8s/podmonitoring.yaml) is the series' job label.
  job_matcher    = "job=\"pubsub-outbox-dispatcher\""
  scoped_matcher = "${local.job_matcher},project_id=\"${var.project_id}\",cluster=\"${var.cluster}\",namespace=\"${var.namespace}\""
  unit_seconds   = { s = 1, m = 60, h = 3600 }

  groups = yamldecode(file(var.rules_file)).spec.groups
  # Every alerting rule (recording rules stay in the cluster), by name.
  alerts = merge([
    for g in local.groups : {
      for r in g.rules : r.alert => {
        severity = r.labels.severity
        labels   = r.labels
        query    = replace(r.expr, local.job_matcher, local.scoped_matcher)
        # Prometheus durations ("5m", "2h") as the API's seconds; `for` is optional (0s).
        duration            = "${tonumber(regex("^([0-9]+)([smh])$", try(r["for"], "0s"))[0]) * local.unit_seconds[regex("^([0-9]+)([smh])$", try(r["for"], "0s"))[1]]}s"
        evaluation_interval = "${tonumber(regex("^([0-9]+)([smh])$", g.interval)[0]) * local.unit_seconds[regex("^([0-9]+)([smh])$", g.interval)[1]]}s"
        # The rule's description is plain text (deploy/check); `summary` may hold {{ }} templates,
        # which Cloud Monitoring's documentation does not expand, so it stays out.
        documentation = <<-EOT
          ${r.annotations.description}

          Install: cluster `${var.cluster}`, namespace `${var.namespace}`. What to do:
          `${r.annotations.runbook}` in the pubsub-outbox repository (the release you run).
        EOT
      } if can(r.alert)
    }
  ]...)
  # The outputs (locals too, so that deploy/check can read them with `terraform console`).
  page    = { for name, a in local.alerts : name => a if a.severity == "page" && var.enabled }
  warning = { for name, a in local.alerts : name => a if a.severity == "warning" && var.enabled }
}

output "page" {
  description = "The alerts labelled severity: page, by name: someone acts now."
  value       = local.page
}

output "warning" {
  description = "The alerts labelled severity: warning, by name: a ticket."
  value       = local.warning
}
