output "cloudsql_connection_name" {
  description = "PROJECT:REGION:INSTANCE, for deploy/k8s/common/configmap.yaml (CSQL_PROXY_INSTANCE_CONNECTION_NAME)."
  value       = google_sql_database_instance.outbox.connection_name
}

output "cloudsql_private_ip" {
  description = "The instance's private address (the proxies find it themselves)."
  value       = google_sql_database_instance.outbox.private_ip_address
}

output "dispatcher_service_account_email" {
  description = "For the iam.gke.io/gcp-service-account annotation in deploy/k8s/serviceaccount.yaml."
  value       = google_service_account.dispatcher.email
}

output "producer_service_account_email" {
  description = "Identity of the producer job (BigQuery, Cloud SQL, its streams file)."
  value       = google_service_account.producer.email
}

output "scheduler_service_account_email" {
  description = "Identity Cloud Scheduler uses to start the producer job."
  value       = google_service_account.scheduler.email
}

output "topic_ids" {
  description = "Full topic names (projects/P/topics/T), as stored in pubsub_outbox.topic."
  value       = { for name, t in google_pubsub_topic.outbox : name => t.id }
}

output "example_subscription_ids" {
  description = "The example subscriptions, by topic."
  value       = { for name, s in google_pubsub_subscription.example : name => s.id }
}

output "producer_job_name" {
  description = "Run it by hand with: gcloud run jobs execute NAME --region REGION --wait"
  value       = google_cloud_run_v2_job.producer.name
}

output "artifact_registry_url" {
  description = "The images' Docker repository, REGION-docker.pkg.dev/PROJECT/REPOSITORY: push the dispatcher's and producer's images and the mirrored postgres there (deploy/README.md, section 1)."
  value       = local.artifact_registry_url
}

output "pubsub_regional_endpoint" {
  description = "For OUTBOX_PUBSUB_ENDPOINT in deploy/k8s/dispatcher.env."
  value       = "https://${var.region}-pubsub.googleapis.com"
}

output "operator_service_account_email" {
  description = "For the iam.gke.io/gcp-service-account annotation of the operator Job's KSA (deploy/k8s/operator/serviceaccount.yaml)."
  value       = google_service_account.operator.email
}

output "console_service_account_email" {
  description = "For the iam.gke.io/gcp-service-account annotation of the console's KSA (deploy/k8s/console/serviceaccount.yaml); null unless console_enabled."
  value       = one(google_service_account.console[*].email)
}

output "console_address" {
  description = "The console Ingress's reserved address: the A record of its host name (deploy/k8s/console/ingress.yaml); null unless console_enabled."
  value       = one(google_compute_global_address.console[*].address)
}

output "bootstrap_service_account_email" {
  description = "For the iam.gke.io/gcp-service-account annotation of the bootstrap Job's KSA (deploy/k8s/bootstrap/serviceaccount.yaml)."
  value       = google_service_account.bootstrap.email
}

output "migrate_service_account_email" {
  description = "For the iam.gke.io/gcp-service-account annotation of the migration Job's KSA (deploy/k8s/migrate/serviceaccount.yaml)."
  value       = google_service_account.migrate.email
}

output "database_users" {
  description = "The IAM database users (PostgreSQL role names), by workload (the operators log in as their own emails)."
  value       = local.db_users
}

output "database_urls" {
  description = "DATABASE_URL per workload, through a proxy on 127.0.0.1:5432. No password: not secret."
  value       = local.database_urls
}

output "database_bootstrap_job_command" {
  description = "The same bootstrap runs as deploy/k8s/bootstrap/run lines: psql in a Job inside the VPC (deploy/README.md, section 4, step 4). Names only, no password."
  value = join("", concat(
    ["deploy/k8s/bootstrap/run migrator='${local.db_users["migrate"]}' dispatcher='${local.db_users["dispatcher"]}' producer='${local.db_users["producer"]}' operator='${local.db_users["operator"]}'\n"],
    [for k, name in local.db_users : "deploy/k8s/bootstrap/run operator='${name}'\n" if k == "console"],
    [for name in keys(google_sql_user.operator) : "deploy/k8s/bootstrap/run operator='${name}'\n"],
  ))
}

locals {
  # The administrator's psql, through a local proxy; it prompts for the postgres password.
  bootstrap_psql = "psql \"host=127.0.0.1 port=5432 dbname=${var.db_name} user=postgres\" -v ON_ERROR_STOP=1"
}

output "database_bootstrap_command" {
  description = <<-EOT
    The bootstrap (deploy/sql/bootstrap.sql), run by an administrator through a local proxy: one
    run for the workloads and the in-cluster operator, one for the console (console_enabled), then
    one per operator in var.operators and var.operator_groups (each run is idempotent and prompts for the password). Names only, no
    password; see deploy/README.md.
  EOT
  value = join("", concat(
    [<<-EOT
      ${local.bootstrap_psql} \
        -v migrator='${local.db_users["migrate"]}' \
        -v dispatcher='${local.db_users["dispatcher"]}' \
        -v producer='${local.db_users["producer"]}' \
        -v operator='${local.db_users["operator"]}' \
        -f deploy/sql/bootstrap.sql
    EOT
    ],
    # The console's login is an operator too (console_enabled).
    [for k, name in local.db_users : "${local.bootstrap_psql} -v operator='${name}' -f deploy/sql/bootstrap.sql\n" if k == "console"],
    [for name in keys(google_sql_user.operator) : "${local.bootstrap_psql} -v operator='${name}' -f deploy/sql/bootstrap.sql\n"],
  ))
}
