output "cloudsql_connection_name" {
  description = "PROJECT:REGION:INSTANCE, for deploy/k8s/common/configmap.yaml (CSQL_PROXY_INSTANCE_CONNECTION_NAME)."
  value       = google_sql_database_instance.outbox.connection_name
}

output "cloudsql_private_ip" {
  description = "The instance's private address (the proxies find it themselves)."
  value       = google_sql_database_instance.outbox.private_ip_address
}

output "dispatcher_service_account_email" {
  description = "For the iam.gke.io/gcp-service-account annotation in deploy/k8s/common/serviceaccount.yaml."
  value       = google_service_account.dispatcher.email
}

output "producer_service_account_email" {
  description = "Identity of the producer job (BigQuery, Cloud SQL, its secrets)."
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

output "pubsub_regional_endpoint" {
  description = "For OUTBOX_PUBSUB_ENDPOINT in deploy/k8s/common/configmap.yaml."
  value       = "https://${var.region}-pubsub.googleapis.com"
}

output "dispatcher_database_url_secret" {
  description = "Secret Manager secret holding the dispatcher's DATABASE_URL (via the proxy sidecar)."
  value       = google_secret_manager_secret.dispatcher_database_url.secret_id
}

output "kubectl_create_database_secret" {
  description = "Creates the Kubernetes Secret the dispatcher and the migration Job read."
  value       = <<-EOT
    kubectl -n ${var.gke_namespace} create secret generic pubsub-outbox-database \
      --from-literal=DATABASE_URL="$(gcloud secrets versions access latest --project ${var.project_id} --secret ${google_secret_manager_secret.dispatcher_database_url.secret_id})"
  EOT
}
