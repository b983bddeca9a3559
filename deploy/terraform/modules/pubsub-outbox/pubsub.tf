# The topics the dispatcher publishes to, and one example subscription per topic.

resource "google_pubsub_topic" "outbox" {
  for_each = toset(var.topics)

  name = each.value
  # Topic-level retention keeps messages for replay (seek) regardless of subscriptions' acks.
  message_retention_duration = var.topic_message_retention
  # Optional CMEK (var.kms_key_name); null: Google-managed encryption. The Pub/Sub service agent
  # is granted the key first (kms.tf).
  kms_key_name = var.kms_key_name

  dynamic "message_storage_policy" {
    for_each = length(var.topic_persistence_regions) > 0 ? [1] : []
    content {
      allowed_persistence_regions = var.topic_persistence_regions
    }
  }

  depends_on = [google_project_service.enabled, google_kms_crypto_key_iam_member.service_agents]

  lifecycle {
    # Removing a name from var.topics would delete the topic with its retained messages, and the
    # rows still waiting for it would be held (the grant gone): refuse such a plan. To really
    # remove one, deploy/README.md ("Removing a topic or the database").
    prevent_destroy = true
  }
}

# A starting point for consumers, not something the outbox needs. Every message carries the
# dedupe_key attribute (OUTBOX_DEDUPE_ATTRIBUTE): delivery is at least once, so consumers drop
# duplicates by it.
resource "google_pubsub_subscription" "example" {
  for_each = var.create_example_subscriptions ? toset(var.topics) : toset([])

  name                       = "${each.value}-example"
  topic                      = google_pubsub_topic.outbox[each.value].id
  ack_deadline_seconds       = 60
  message_retention_duration = var.subscription_message_retention
  retain_acked_messages      = false

  # The consumer's choice, set here as the example: messages sharing an ordering key are delivered
  # in the order published (the dispatcher publishes each key in outbox id order, from one
  # region). It limits throughput per key and holds a key back while a message of it is
  # unacknowledged; consumers that do not care about order should turn it off.
  enable_message_ordering = true

  # Never delete the subscription for inactivity (the default TTL is 31 days).
  expiration_policy {
    ttl = ""
  }

  retry_policy {
    minimum_backoff = "10s"
    maximum_backoff = "600s"
  }

  # No dead_letter_policy, deliberately: what to do with a message a consumer cannot process is the
  # consumer's decision. (The outbox's own dead-letter table is about publishing, not consuming.)

  lifecycle {
    # A consumer may already read from it: deleting it (a name removed from var.topics, or
    # create_example_subscriptions turned off) would drop its unacknowledged messages, and a new
    # one of the same name starts empty. Refuse such a plan, as for the topics; to really remove
    # one, deploy/README.md ("Removing a topic or the database").
    prevent_destroy = true
  }
}
