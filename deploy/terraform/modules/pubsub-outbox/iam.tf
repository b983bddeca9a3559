# Identities and their grants, least privilege first: topic-, dataset-, secret- and job-level
# where the API allows it; the Cloud SQL roles are project-level bindings with an IAM condition
# that limits them to the outbox instance. Every binding is listed, with its reason, in
# deploy/README.md ("IAM bindings").

resource "google_service_account" "dispatcher" {
  account_id   = "${var.name_prefix}-dispatcher"
  display_name = "pubsub-outbox dispatcher (GKE, Workload Identity)"
  depends_on   = [google_project_service.enabled]
}

# The migration Job's own identity: the schema owner in the database, no Pub/Sub rights.
resource "google_service_account" "migrate" {
  account_id   = "${var.name_prefix}-migrate"
  display_name = "pubsub-outbox schema migrations (GKE Job, Workload Identity)"
  depends_on   = [google_project_service.enabled]
}

resource "google_service_account" "producer" {
  account_id   = "${var.name_prefix}-producer"
  display_name = "pubsub-outbox producer (Cloud Run Job)"
  depends_on   = [google_project_service.enabled]
}

# The in-cluster operator's identity (deploy/k8s/operator): an on-call person runs the operator
# commands as a Job under it instead of borrowing the dispatcher's identity, whose database role
# is denied most of them. In the database it is a member of outbox_operator (the bootstrap); it has
# no Pub/Sub, BigQuery or secret rights.
resource "google_service_account" "operator" {
  account_id   = "${var.name_prefix}-operator"
  display_name = "pubsub-outbox operator commands (GKE Job, Workload Identity)"
  depends_on   = [google_project_service.enabled]
}

# The bootstrap Job's identity (deploy/k8s/bootstrap): its proxy opens the tunnel as this account,
# and psql logs in as postgres with the password. cloudsql.client only (connect, get): no IAM
# database user, no instanceUser, so the account itself can log in to nothing.
resource "google_service_account" "bootstrap" {
  account_id   = "${var.name_prefix}-bootstrap"
  display_name = "pubsub-outbox bootstrap Job (GKE, Workload Identity; the proxy's tunnel only)"
  depends_on   = [google_project_service.enabled]
}

resource "google_service_account" "scheduler" {
  account_id   = "${var.name_prefix}-scheduler"
  display_name = "pubsub-outbox scheduler (starts the producer job)"
  depends_on   = [google_project_service.enabled]
}

locals {
  # The service accounts that reach Cloud SQL, each through an Auth Proxy that logs in as it.
  db_workloads = merge(
    {
      dispatcher = { email = google_service_account.dispatcher.email }
      migrate    = { email = google_service_account.migrate.email }
      producer   = { email = google_service_account.producer.email }
      operator   = { email = google_service_account.operator.email }
    },
    # The console (console.tf), when console_enabled.
    { for sa in google_service_account.console : "console" => { email = sa.email } },
  )
  # Everyone who logs in to the database, by a key that is known at plan time: the workloads, and
  # the people and Google groups of var.operators / var.operator_groups, who run the proxy on
  # their own machine with their own credentials (a group's members log in as themselves).
  db_principals = merge(
    { for name, w in local.db_workloads : name => "serviceAccount:${w.email}" },
    { for email in var.operators : "user:${email}" => "user:${email}" },
    { for email in var.operator_groups : "group:${email}" => "group:${email}" },
  )
  # cloudsql.client: the proxy's connect + get (ephemeral certificate, instance metadata).
  # cloudsql.instanceUser: cloudsql.instances.login, the IAM database login itself.
  db_roles = ["roles/cloudsql.client", "roles/cloudsql.instanceUser"]
  db_bindings = {
    for pair in setproduct(keys(local.db_principals), local.db_roles) :
    "${pair[0]} ${pair[1]}" => { principal = pair[0], role = pair[1] }
  }
}

# Cloud SQL roles have no instance-level IAM policy: grant them on the project, conditioned on
# this one instance. The same two roles for every login, workload or person: what a login may do
# inside the database is decided there, by its role (deploy/README.md, "Database roles").
resource "google_project_iam_member" "cloudsql" {
  for_each = local.db_bindings

  project = var.project_id
  role    = each.value.role
  member  = local.db_principals[each.value.principal]

  condition {
    title       = "only-${google_sql_database_instance.outbox.name}"
    description = "Only the pubsub-outbox Cloud SQL instance."
    expression  = "resource.type == 'sqladmin.googleapis.com/Instance' && resource.name == 'projects/${var.project_id}/instances/${google_sql_database_instance.outbox.name}'"
  }
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

# Workload Identity: the Kubernetes service account gke_namespace/gke_service_account may act as
# this Google service account (the KSA carries the iam.gke.io/gcp-service-account annotation).
resource "google_service_account_iam_member" "dispatcher_workload_identity" {
  service_account_id = google_service_account.dispatcher.name
  role               = "roles/iam.workloadIdentityUser"
  member             = local.dispatcher_workload_identity_member
}

# ---- migrations ---------------------------------------------------------------------------------

resource "google_service_account_iam_member" "migrate_workload_identity" {
  service_account_id = google_service_account.migrate.name
  role               = "roles/iam.workloadIdentityUser"
  member             = local.migrate_workload_identity_member
}

# ---- operator (in-cluster commands) -------------------------------------------------------------

# Pods running as the Kubernetes service account gke_namespace/gke_operator_service_account (the
# operator Job) act as the operator. Whoever may create pods or Jobs in that namespace may
# therefore run the operator commands (and could name the dispatcher's service account just as
# well): keep that Kubernetes right to the people on call.
resource "google_service_account_iam_member" "operator_workload_identity" {
  service_account_id = google_service_account.operator.name
  role               = "roles/iam.workloadIdentityUser"
  member             = local.operator_workload_identity_member
}

# ---- bootstrap (the administrator's Job) --------------------------------------------------------

resource "google_project_iam_member" "bootstrap_cloudsql_client" {
  project = var.project_id
  role    = "roles/cloudsql.client"
  member  = "serviceAccount:${google_service_account.bootstrap.email}"

  condition {
    title       = "only-${google_sql_database_instance.outbox.name}"
    description = "Only the pubsub-outbox Cloud SQL instance."
    expression  = "resource.type == 'sqladmin.googleapis.com/Instance' && resource.name == 'projects/${var.project_id}/instances/${google_sql_database_instance.outbox.name}'"
  }
}

resource "google_service_account_iam_member" "bootstrap_workload_identity" {
  service_account_id = google_service_account.bootstrap.name
  role               = "roles/iam.workloadIdentityUser"
  member             = local.bootstrap_workload_identity_member
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

# The streams file, mounted into the job. It holds queries, not credentials.
resource "google_secret_manager_secret_iam_member" "producer_reads_streams" {
  secret_id = google_secret_manager_secret.producer_streams.id
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

# ---- tracing (tracing_enabled; docs/tracing.md) ---------------------------------------------------

# Cloud Trace's OTLP endpoint takes spans from a principal with cloudtrace.traces.patch: the
# dispatcher (GKE, Workload Identity) and the producer (Cloud Run Job) export their own.
resource "google_project_iam_member" "trace_agent" {
  for_each = var.tracing_enabled ? {
    dispatcher = google_service_account.dispatcher.email
    producer   = google_service_account.producer.email
  } : {}

  project = var.project_id
  role    = "roles/cloudtrace.agent"
  member  = "serviceAccount:${each.value}"
}

# ---- the HPAs' metrics adapter (custom_metrics_adapter_monitoring_viewer) ------------------------

# The dispatcher's HPAs scale on an external metric (deploy/k8s/dispatcher/hpa.yaml) that the
# Custom Metrics Stackdriver Adapter reads from Cloud Monitoring as its Kubernetes service account
# custom-metrics/custom-metrics-stackdriver-adapter. Through Workload Identity that KSA is a
# principal of the GKE project's pool, granted here directly (no Google service account to
# impersonate): its project number is needed for the principal's name.
data "google_project" "gke" {
  count = var.custom_metrics_adapter_monitoring_viewer ? 1 : 0

  # No depends_on: a data source waiting on a changed dependency is read only at apply, and the
  # binding's principal would then be unknown and replaced on every plan that enables an API.
  project_id = local.gke_project_id
}

resource "google_project_iam_member" "custom_metrics_adapter" {
  count = var.custom_metrics_adapter_monitoring_viewer ? 1 : 0

  project = local.gke_project_id
  role    = "roles/monitoring.viewer"
  member  = "principal://iam.googleapis.com/projects/${data.google_project.gke[0].number}/locations/global/workloadIdentityPools/${local.gke_project_id}.svc.id.goog/subject/ns/custom-metrics/sa/custom-metrics-stackdriver-adapter"
}
