-- The audit trail records who was logged in, next to who the operator said they are.
--
-- `actor` is declared (--actor, OUTBOX_ACTOR, the OS user): useful, but anyone can type anything.
-- `db_user` is the authenticated database identity of the session that wrote the row (on Cloud SQL
-- the IAM user, e.g. oncall@example.com). A trigger sets it, so a value given in the INSERT is
-- overwritten and the column cannot be forged by the writer; operators have no UPDATE or DELETE
-- on this table. Rows written before this migration keep NULL (not recorded).
ALTER TABLE pubsub_outbox_audit ADD COLUMN db_user TEXT;

CREATE FUNCTION pubsub_outbox_audit_db_user() RETURNS trigger
    LANGUAGE plpgsql AS $$
BEGIN
    NEW.db_user := session_user;
    RETURN NEW;
END
$$;

CREATE TRIGGER pubsub_outbox_audit_db_user
    BEFORE INSERT ON pubsub_outbox_audit
    FOR EACH ROW EXECUTE FUNCTION pubsub_outbox_audit_db_user();
