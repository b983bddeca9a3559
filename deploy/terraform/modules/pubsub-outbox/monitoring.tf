# Cloud Monitoring alerts: the dispatcher's (its Prometheus rules, deploy/k8s/alerts.yaml, as
# PromQL policies), the producer's, which exports no Prometheus metrics (a batch job cannot be
# scraped), and the Cloud SQL instance's under the outbox (a queue table's main failure modes).

# ---- the dispatcher ------------------------------------------------------------------------------

# The rules of deploy/k8s/alerts.yaml, read here rather than copied, so the cluster's Rules and
# these policies cannot drift; scoped to this install's project, cluster and namespace.
module "dispatcher_alerts" {
  source = "../dispatcher_alerts"

  # deploy/k8s/alerts.yaml, from deploy/terraform/modules/pubsub-outbox.
  rules_file = "${path.module}/../../../k8s/alerts.yaml"
  project_id = local.gke_project_id
  cluster    = var.gke_cluster_name
  namespace  = var.gke_namespace
  # Off for the first apply (the environment's release.auto.tfvars): no policy exists until the
  # dispatcher runs.
  enabled = var.alerts_enabled
}

# The alerts labelled `severity: page`, each a policy that notifies alert_notification_channels:
# GMP's Rules send only to an Alertmanager, which nothing here configures, so this is the route
# that pages someone. deploy/check fails when a paging alert has no such policy.
resource "google_monitoring_alert_policy" "dispatcher_page" {
  for_each = module.dispatcher_alerts.page

  display_name = "pubsub-outbox ${each.key} (${var.gke_cluster_name}/${var.gke_namespace})"
  combiner     = "OR"
  severity     = "CRITICAL"

  conditions {
    display_name = each.key
    condition_prometheus_query_language {
      query               = each.value.query
      duration            = each.value.duration
      evaluation_interval = each.value.evaluation_interval
      labels              = each.value.labels
      # The dispatcher's series exist only once it has run, and Terraform runs first (section 4 of
      # deploy/README.md): without this the API refuses a query naming a metric it has not seen.
      disable_metric_validation = true
    }
  }

  documentation {
    mime_type = "text/markdown"
    content   = each.value.documentation
  }

  notification_channels = var.alert_notification_channels
  depends_on            = [google_project_service.enabled]

  lifecycle {
    # A page nobody receives is a silent outage: name a channel, or say so.
    precondition {
      condition     = length(var.alert_notification_channels) > 0 || var.allow_alerts_without_notification
      error_message = "alert_notification_channels is empty: the dispatcher's paging alerts would reach nobody. Give at least one notification channel id (projects/P/notificationChannels/N), or set allow_alerts_without_notification = true."
    }
  }
}

# The alerts labelled `severity: warning`: an incident on the console, and a notification to
# alert_warning_notification_channels when it names any (a ticket queue, an email list).
resource "google_monitoring_alert_policy" "dispatcher_warning" {
  for_each = module.dispatcher_alerts.warning

  display_name = "pubsub-outbox ${each.key} (${var.gke_cluster_name}/${var.gke_namespace})"
  combiner     = "OR"
  severity     = "WARNING"

  conditions {
    display_name = each.key
    condition_prometheus_query_language {
      query                     = each.value.query
      duration                  = each.value.duration
      evaluation_interval       = each.value.evaluation_interval
      labels                    = each.value.labels
      disable_metric_validation = true
    }
  }

  documentation {
    mime_type = "text/markdown"
    content   = each.value.documentation
  }

  notification_channels = var.alert_warning_notification_channels
  depends_on            = [google_project_service.enabled]
}

# ---- the producer and the database ---------------------------------------------------------------

# One failed execution is a warning: a task exhausted its retries (exit 1: a stream failed, and
# the next tick resumes from its watermark) or the configuration is invalid (exit 2). The next
# tick shows which: a second failure pages (producer_failing, below).
resource "google_monitoring_alert_policy" "producer_failed" {
  count = var.alerts_enabled ? 1 : 0

  display_name = "pubsub-outbox producer execution failed (${google_cloud_run_v2_job.producer.name})"
  combiner     = "OR"
  severity     = "WARNING"

  conditions {
    display_name = "a failed execution of ${google_cloud_run_v2_job.producer.name}"
    condition_threshold {
      filter          = local.producer_executions_failed
      comparison      = "COMPARISON_GT"
      threshold_value = 0
      duration        = "0s"
      aggregations {
        alignment_period     = "300s"
        per_series_aligner   = "ALIGN_DELTA"
        cross_series_reducer = "REDUCE_SUM"
      }
      trigger {
        count = 1
      }
    }
  }

  documentation {
    mime_type = "text/markdown"
    content   = local.producer_alert_documentation
  }

  notification_channels = var.alert_warning_notification_channels
  depends_on            = [google_project_service.enabled]
}

# What pages: repeated failures, or no success at all.
resource "google_monitoring_alert_policy" "producer_failing" {
  count = var.alerts_enabled ? 1 : 0

  display_name = "pubsub-outbox producer failing (${google_cloud_run_v2_job.producer.name})"
  combiner     = "OR"
  severity     = "ERROR"

  # Two failed executions within 45 minutes (three ticks of the default 15-minute schedule): the
  # tick after a failure failed too, so it is not resuming by itself.
  conditions {
    display_name = "2 failed executions of ${google_cloud_run_v2_job.producer.name} within 45m"
    condition_threshold {
      filter          = local.producer_executions_failed
      comparison      = "COMPARISON_GT"
      threshold_value = 1
      duration        = "0s"
      aggregations {
        alignment_period     = "2700s"
        per_series_aligner   = "ALIGN_DELTA"
        cross_series_reducer = "REDUCE_SUM"
      }
      trigger {
        count = 1
      }
    }
  }

  # No succeeded execution for an hour (4 ticks): the schedule is paused or broken, or every
  # execution times out. Nothing fails, so the condition above stays silent.
  conditions {
    display_name = "no succeeded execution of ${google_cloud_run_v2_job.producer.name} for 1h"
    condition_absent {
      filter = join(" AND ", [
        "resource.type = \"cloud_run_job\"",
        "resource.labels.job_name = \"${google_cloud_run_v2_job.producer.name}\"",
        "metric.type = \"run.googleapis.com/job/completed_execution_count\"",
        "metric.labels.result = \"succeeded\"",
      ])
      duration = "3600s"
      aggregations {
        alignment_period     = "300s"
        per_series_aligner   = "ALIGN_DELTA"
        cross_series_reducer = "REDUCE_SUM"
      }
      trigger {
        count = 1
      }
    }
  }

  documentation {
    mime_type = "text/markdown"
    content   = local.producer_alert_documentation
  }

  notification_channels = var.alert_notification_channels
  depends_on            = [google_project_service.enabled]

  lifecycle {
    # An alert nobody receives is a silent outage: name a channel, or say so.
    precondition {
      condition     = length(var.alert_notification_channels) > 0 || var.allow_alerts_without_notification
      error_message = "alert_notification_channels is empty: give at least one notification channel id (projects/P/notificationChannels/N), or set allow_alerts_without_notification = true to keep the alerts on the console only."
    }
  }
}

locals {
  producer_executions_failed = join(" AND ", [
    "resource.type = \"cloud_run_job\"",
    "resource.labels.job_name = \"${google_cloud_run_v2_job.producer.name}\"",
    "metric.type = \"run.googleapis.com/job/completed_execution_count\"",
    "metric.labels.result = \"failed\"",
  ])
  producer_alert_documentation = <<-EOT
    The pubsub-outbox producer job failed, or has not succeeded for an hour. Read its logs
    (`gcloud run jobs executions list --job ${google_cloud_run_v2_job.producer.name} --region ${var.region}`),
    and the per-stream rows in `producer_run` (outcome, error). Exit 1: a stream failed and the
    next tick resumes from its watermark (one failure is a warning; a second within 45 minutes
    pages). Exit 2: the streams file is invalid; every tick fails until it is fixed. A paused
    schedule (producer_schedule_paused in the environment's release.auto.tfvars) fires the
    absence rule.
  EOT
}

# The database under the queue: transaction-ID use climbing means vacuum cannot freeze (a
# long-held snapshot or a stuck replication slot pins the horizon: the outbox bloats first, then
# wraparound protection stops writes); a full disk or exhausted connections stop every writer.
resource "google_monitoring_alert_policy" "cloudsql_health" {
  count = var.alerts_enabled ? 1 : 0

  display_name = "pubsub-outbox database health (${google_sql_database_instance.outbox.name})"
  combiner     = "OR"
  severity     = "CRITICAL"

  conditions {
    display_name = "transaction IDs over 50 % used (vacuum cannot freeze: a long transaction?)"
    condition_threshold {
      filter = join(" AND ", [
        "resource.type = \"cloudsql_database\"",
        "resource.labels.database_id = \"${var.project_id}:${google_sql_database_instance.outbox.name}\"",
        "metric.type = \"cloudsql.googleapis.com/database/postgresql/transaction_id_utilization\"",
      ])
      comparison      = "COMPARISON_GT"
      threshold_value = 0.5
      duration        = "600s"
      aggregations {
        alignment_period   = "300s"
        per_series_aligner = "ALIGN_MAX"
      }
    }
  }

  conditions {
    display_name = "disk over 85 % full"
    condition_threshold {
      filter = join(" AND ", [
        "resource.type = \"cloudsql_database\"",
        "resource.labels.database_id = \"${var.project_id}:${google_sql_database_instance.outbox.name}\"",
        "metric.type = \"cloudsql.googleapis.com/database/disk/utilization\"",
      ])
      comparison      = "COMPARISON_GT"
      threshold_value = 0.85
      duration        = "600s"
      aggregations {
        alignment_period   = "300s"
        per_series_aligner = "ALIGN_MAX"
      }
    }
  }

  conditions {
    display_name = "connections over 80 % of max_connections"
    condition_threshold {
      filter = join(" AND ", [
        "resource.type = \"cloudsql_database\"",
        "resource.labels.database_id = \"${var.project_id}:${google_sql_database_instance.outbox.name}\"",
        "metric.type = \"cloudsql.googleapis.com/database/postgresql/num_backends\"",
      ])
      comparison      = "COMPARISON_GT"
      threshold_value = 0.8 * var.db_max_connections
      duration        = "300s"
      aggregations {
        alignment_period     = "60s"
        per_series_aligner   = "ALIGN_MAX"
        cross_series_reducer = "REDUCE_SUM"
      }
    }
  }

  documentation {
    mime_type = "text/markdown"
    content   = <<-EOT
      The outbox database needs attention. Transaction IDs: find what holds the vacuum horizon
      (`dispatcher status` lists long transactions; also `pg_stat_activity`, `pg_replication_slots`,
      `pg_prepared_xacts`) and end it. Disk: the outbox is bloated (dead rows behind a held
      snapshot) or the backlog is large; `dispatcher status` shows both. Connections: compare the
      replicas x pool budget in deploy/k8s/dispatcher/hpa.yaml with db_max_connections.
    EOT
  }

  notification_channels = var.alert_notification_channels
  depends_on            = [google_project_service.enabled]

  lifecycle {
    # An alert nobody receives is a silent outage: name a channel, or say so.
    precondition {
      condition     = length(var.alert_notification_channels) > 0 || var.allow_alerts_without_notification
      error_message = "alert_notification_channels is empty: the database alerts would reach nobody. Give at least one notification channel id (projects/P/notificationChannels/N), or set allow_alerts_without_notification = true."
    }
  }
}

# The producer's watermark lag per stream, from its "Stream summary." log line
# (watermark_lag_seconds: how far behind now the stream's watermark stands after the run), as a
# logs-based distribution: a batch job exports no Prometheus metrics.
resource "google_logging_metric" "producer_watermark_lag" {
  name   = "${var.name_prefix}-producer-watermark-lag"
  filter = <<-EOT
    resource.type="cloud_run_job"
    resource.labels.job_name="${google_cloud_run_v2_job.producer.name}"
    jsonPayload.message="Stream summary."
    jsonPayload.watermark_lag_seconds>=0
  EOT

  metric_descriptor {
    metric_kind = "DELTA"
    value_type  = "DISTRIBUTION"
    unit        = "s"
    labels {
      key         = "stream"
      value_type  = "STRING"
      description = "The producer stream (streams file)."
    }
  }
  value_extractor = "EXTRACT(jsonPayload.watermark_lag_seconds)"
  label_extractors = {
    stream = "EXTRACT(jsonPayload.stream)"
  }
  bucket_options {
    exponential_buckets {
      num_finite_buckets = 32
      growth_factor      = 2
      scale              = 1
    }
  }
  depends_on = [google_project_service.enabled]
}

# One dashboard over the dispatcher's managed-Prometheus metrics (PromQL, this install's cluster
# and namespace) and the producer job's (Cloud Run's executions, the logs-based lag above): backlog
# and oldest claimable age per topic, publish rate and latency, dead letters, blocked keys, the
# breaker, replicas, paused topics, producer executions and lag. deploy/check parses
# dashboard.json and checks that every metric it names is one the dispatcher exports. Tiles at
# x or y 0 leave the position out, as the API returns them (an explicit 0 would show as a change
# on every plan).
resource "google_monitoring_dashboard" "outbox" {
  dashboard_json = templatefile("${path.module}/dashboard.json", {
    # The GKE cluster's project (the series' project_id label): two projects in one metrics scope
    # may hold clusters of the same name.
    project_id   = local.gke_project_id
    cluster      = var.gke_cluster_name
    namespace    = var.gke_namespace
    producer_job = google_cloud_run_v2_job.producer.name
    lag_metric   = google_logging_metric.producer_watermark_lag.name
  })
  depends_on = [google_project_service.enabled]
}
