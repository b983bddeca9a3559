# Identities and their grants, least privilege first: topic- and dataset-level where the API
# allows it, project-level only for roles that have no narrower resource.

resource "google_service_account" "dispatcher" {
  account_id   = "${var.name_prefix}-dispatcher"
  display_name = "pubsub-outbox dispatcher (GKE, Workload Identity)"
  depends_on   = [google_project_service.enabled]
}

resource "google_service_account" "producer" {
  account_id   = "${var.name_prefix}-producer"
  display_name = "pubsub-outbox producer (Cloud Run Job)"
  depends_on   = [google_project_service.enabled]
}

resource "google_service_account" "scheduler" {
  account_id   = "${var.name_prefix}-scheduler"
  display_name = "pubsub-outbox scheduler (starts the producer job)"
  depends_on   = [google_project_service.enabled]
}

# ---- dispatcher ---------------------------------------------------------------------------------

resource "google_pubsub_topic_iam_member" "dispatcher_publishes" {
  for_each = google_pubsub_topic.outbox

  topic  = each.value.name
  role   = "roles/pubsub.publisher"
  member = "serviceAccount:${google_service_account.dispatcher.email}"
}

# When a whole batch fails, the dispatcher calls GetTopic to tell a Pub/Sub outage (no answer)
# from a message problem (any answer). PERMISSION_DENIED counts as an answer, so this is not
# required, but with it the probe does not fill the audit logs with denials.
resource "google_pubsub_topic_iam_member" "dispatcher_views" {
  for_each = google_pubsub_topic.outbox

  topic  = each.value.name
  role   = "roles/pubsub.viewer"
  member = "serviceAccount:${google_service_account.dispatcher.email}"
}

# Used by the Cloud SQL Auth Proxy sidecar (cloudsql.instances.connect/get). No narrower scope.
resource "google_project_iam_member" "dispatcher_cloudsql_client" {
  project = var.project_id
  role    = "roles/cloudsql.client"
  member  = "serviceAccount:${google_service_account.dispatcher.email}"
}

# Workload Identity: the Kubernetes service account gke_namespace/gke_service_account may act as
# this Google service account (the KSA carries the iam.gke.io/gcp-service-account annotation).
resource "google_service_account_iam_member" "dispatcher_workload_identity" {
  service_account_id = google_service_account.dispatcher.name
  role               = "roles/iam.workloadIdentityUser"
  member             = local.dispatcher_workload_identity_member
}

# ---- producer -----------------------------------------------------------------------------------

# Create query jobs in (and bill them to) the BigQuery project.
resource "google_project_iam_member" "producer_bigquery_job_user" {
  project = local.bigquery_project_id
  role    = "roles/bigquery.jobUser"
  member  = "serviceAccount:${google_service_account.producer.email}"
}

# Read only the datasets the streams query.
resource "google_bigquery_dataset_iam_member" "producer_reads" {
  for_each = {
    for d in var.bigquery_datasets :
    "${coalesce(d.project, var.project_id)}:${d.dataset_id}" => d
  }

  project    = coalesce(each.value.project, var.project_id)
  dataset_id = each.value.dataset_id
  role       = "roles/bigquery.dataViewer"
  member     = "serviceAccount:${google_service_account.producer.email}"
}

# Cloud Run's /cloudsql volume connects as the job's service account.
resource "google_project_iam_member" "producer_cloudsql_client" {
  project = var.project_id
  role    = "roles/cloudsql.client"
  member  = "serviceAccount:${google_service_account.producer.email}"
}

resource "google_secret_manager_secret_iam_member" "producer_reads_streams" {
  secret_id = google_secret_manager_secret.producer_streams.id
  role      = "roles/secretmanager.secretAccessor"
  member    = "serviceAccount:${google_service_account.producer.email}"
}

resource "google_secret_manager_secret_iam_member" "producer_reads_database_url" {
  secret_id = google_secret_manager_secret.producer_database_url.id
  role      = "roles/secretmanager.secretAccessor"
  member    = "serviceAccount:${google_service_account.producer.email}"
}

# ---- scheduler ----------------------------------------------------------------------------------

# Run (execute) this one job, nothing else. Cloud Scheduler's service agent mints the OAuth token
# for this account; it has the rights by default (roles/cloudscheduler.serviceAgent).
resource "google_cloud_run_v2_job_iam_member" "scheduler_runs_producer" {
  location = google_cloud_run_v2_job.producer.location
  name     = google_cloud_run_v2_job.producer.name
  role     = "roles/run.invoker"
  member   = "serviceAccount:${google_service_account.scheduler.email}"
}
