# The module's outputs, passed through: `terraform output` in this directory prints them
# (deploy/README.md, sections 3 to 5, say which goes where).

output "cloudsql_connection_name" {
  description = "PROJECT:REGION:INSTANCE, for deploy/k8s/common/configmap.yaml (CSQL_PROXY_INSTANCE_CONNECTION_NAME)."
  value       = module.pubsub_outbox.cloudsql_connection_name
}

output "cloudsql_private_ip" {
  description = "The instance's private address (the proxies find it themselves)."
  value       = module.pubsub_outbox.cloudsql_private_ip
}

output "dispatcher_service_account_email" {
  description = "For the iam.gke.io/gcp-service-account annotation in deploy/k8s/serviceaccount.yaml."
  value       = module.pubsub_outbox.dispatcher_service_account_email
}

output "producer_service_account_email" {
  description = "Identity of the producer job."
  value       = module.pubsub_outbox.producer_service_account_email
}

output "scheduler_service_account_email" {
  description = "Identity Cloud Scheduler uses to start the producer job."
  value       = module.pubsub_outbox.scheduler_service_account_email
}

output "topic_ids" {
  description = "Full topic names (projects/P/topics/T), as stored in pubsub_outbox.topic."
  value       = module.pubsub_outbox.topic_ids
}

output "example_subscription_ids" {
  description = "The example subscriptions, by topic."
  value       = module.pubsub_outbox.example_subscription_ids
}

output "producer_job_name" {
  description = "Run it by hand with: gcloud run jobs execute NAME --region REGION --wait"
  value       = module.pubsub_outbox.producer_job_name
}

output "artifact_registry_url" {
  description = "The images' Docker repository (REGION-docker.pkg.dev/PROJECT/REPOSITORY)."
  value       = module.pubsub_outbox.artifact_registry_url
}

output "pubsub_regional_endpoint" {
  description = "For OUTBOX_PUBSUB_ENDPOINT in deploy/k8s/dispatcher.env."
  value       = module.pubsub_outbox.pubsub_regional_endpoint
}

output "operator_service_account_email" {
  description = "For the operator Job's KSA (deploy/k8s/operator/serviceaccount.yaml)."
  value       = module.pubsub_outbox.operator_service_account_email
}

output "console_service_account_email" {
  description = "For the console's KSA (deploy/k8s/console/serviceaccount.yaml); null unless console_enabled."
  value       = module.pubsub_outbox.console_service_account_email
}

output "console_address" {
  description = "The console Ingress's reserved address; null unless console_enabled."
  value       = module.pubsub_outbox.console_address
}

output "bootstrap_service_account_email" {
  description = "For the bootstrap Job's KSA (deploy/k8s/bootstrap/serviceaccount.yaml)."
  value       = module.pubsub_outbox.bootstrap_service_account_email
}

output "migrate_service_account_email" {
  description = "For the migration Job's KSA (deploy/k8s/migrate/serviceaccount.yaml)."
  value       = module.pubsub_outbox.migrate_service_account_email
}

output "database_users" {
  description = "The IAM database users (PostgreSQL role names), by workload."
  value       = module.pubsub_outbox.database_users
}

output "database_urls" {
  description = "DATABASE_URL per workload, through a proxy on 127.0.0.1:5432. No password: not secret."
  value       = module.pubsub_outbox.database_urls
}

output "database_bootstrap_job_command" {
  description = "The bootstrap as deploy/k8s/bootstrap/run lines (deploy/README.md, section 4, step 4)."
  value       = module.pubsub_outbox.database_bootstrap_job_command
}

output "database_bootstrap_command" {
  description = "The bootstrap through a local proxy (deploy/sql/bootstrap.sql), one psql run per line."
  value       = module.pubsub_outbox.database_bootstrap_command
}
