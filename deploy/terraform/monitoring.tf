# Cloud Monitoring alert for the producer, which exports no Prometheus metrics (a batch job cannot
# be scraped). The dispatcher's alerts are Prometheus rules (deploy/k8s/alerts.yaml).

# Any failed execution: a task exhausted its retries (exit 1: a stream failed, the next tick
# resumes from its watermark) or the configuration is invalid (exit 2: every tick fails until it
# is fixed). Either way someone should read the job's logs.
resource "google_monitoring_alert_policy" "producer_failed" {
  display_name = "pubsub-outbox producer execution failed (${google_cloud_run_v2_job.producer.name})"
  combiner     = "OR"
  severity     = "ERROR"

  conditions {
    display_name = "failed executions of ${google_cloud_run_v2_job.producer.name}"
    condition_threshold {
      filter = join(" AND ", [
        "resource.type = \"cloud_run_job\"",
        "resource.labels.job_name = \"${google_cloud_run_v2_job.producer.name}\"",
        "metric.type = \"run.googleapis.com/job/completed_execution_count\"",
        "metric.labels.result = \"failed\"",
      ])
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
    content   = <<-EOT
      The pubsub-outbox producer job failed or has not succeeded for an hour. Read its logs
      (`gcloud run jobs executions list --job ${google_cloud_run_v2_job.producer.name} --region ${var.region}`),
      and the per-stream rows in `producer_run` (outcome, error). Exit 1: a stream failed and the
      next tick resumes from its watermark. Exit 2: the streams file is invalid; every tick fails
      until it is fixed. A paused schedule (producer_schedule_paused) also fires the absence rule.
    EOT
  }

  notification_channels = var.alert_notification_channels
  depends_on            = [google_project_service.enabled]
}
