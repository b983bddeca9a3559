# Secret Manager holds one thing: the producer's streams file, because Secret Manager is how Cloud
# Run mounts a file into a job. It holds BigQuery queries, not credentials. There is no database
# password to store: every workload logs in with IAM database authentication (cloudsql.tf).
#
# A new version per change of the file (var.producer_streams: the environment's committed
# streams.toml); the job mounts the version this apply wrote (cloudrun_job.tf), never "latest", so
# a changed file is a change of the job, seen in the plan.
resource "google_secret_manager_secret" "producer_streams" {
  secret_id = "${var.name_prefix}-producer-streams"
  replication {
    auto {}
  }
  depends_on = [google_project_service.enabled]
}

resource "google_secret_manager_secret_version" "producer_streams" {
  secret      = google_secret_manager_secret.producer_streams.id
  secret_data = var.producer_streams
}
