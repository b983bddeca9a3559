# Starts one execution of the producer job per tick, by calling the Cloud Run Admin API's
# jobs.run method with an OAuth token of the scheduler's service account (which may run only this
# job). The call returns once the execution is created; it does not wait for the job to finish.

resource "google_cloud_scheduler_job" "producer" {
  name        = "${var.name_prefix}-producer"
  region      = var.region
  description = "Runs the pubsub-outbox producer (Cloud Run Job ${google_cloud_run_v2_job.producer.name})."
  schedule    = var.producer_schedule
  time_zone   = var.producer_time_zone
  paused      = var.producer_schedule_paused

  attempt_deadline = "60s"

  # Retrying a failed start is safe: an execution that finds its streams busy skips them.
  retry_config {
    retry_count          = 2
    min_backoff_duration = "10s"
    max_backoff_duration = "60s"
  }

  http_target {
    http_method = "POST"
    uri         = "https://run.googleapis.com/v2/projects/${var.project_id}/locations/${var.region}/jobs/${google_cloud_run_v2_job.producer.name}:run"
    headers = {
      "Content-Type" = "application/json"
    }
    body = base64encode("{}")

    oauth_token {
      service_account_email = google_service_account.scheduler.email
      scope                 = "https://www.googleapis.com/auth/cloud-platform"
    }
  }

  depends_on = [
    google_project_service.enabled,
    google_cloud_run_v2_job_iam_member.scheduler_runs_producer,
  ]
}
