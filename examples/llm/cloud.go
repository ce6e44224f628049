package main

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"os"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/bedrockruntime"
	"github.com/aws/aws-sdk-go-v2/service/bedrockruntime/types"
	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/azure"
	ooption "github.com/openai/openai-go/v3/option"
	"github.com/redis/go-redis/v9"

	"github.com/sharedquota/quota"
	"github.com/sharedquota/quota/llm"
)

// Azure OpenAI: the deployment (the model the SDK names is its
// deployment's name), its endpoint in -base-url or AZURE_OPENAI_ENDPOINT,
// its key in AZURE_OPENAI_API_KEY.
const (
	azureDeployment = "gpt-4o"
	azureAPIVersion = "2024-10-21"
)

// bedrockModel is the Bedrock model the example asks, in the Region of
// AWS_REGION (us-east-1 when unset), with the credentials of
// AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY and AWS_SESSION_TOKEN;
// -base-url points the SDK at another endpoint.
const bedrockModel = "us.anthropic.claude-sonnet-4-20250514-v1:0"

// azureLimits are the deployment's, as its quota page shows them.
var azureLimits = llm.AzureLimits{TokensPerMinute: 30000}

// azureTransport returns the Transport of an Azure OpenAI deployment:
// its requests a minute are 6 for each 1,000 of its tokens a minute.
func azureTransport(rdb *redis.Client) *quota.Transport {
	return quota.NewTransport(rdb, azureLimits.Requests(), quota.WithMetering(llm.Azure(azureLimits)))
}

// bedrockTransport returns the Transport of a Bedrock model's quotas:
// Claude Sonnet 4's output tokens take 5 of the tokens a minute each.
func bedrockTransport(rdb *redis.Client) *quota.Transport {
	return quota.NewTransport(rdb, quota.PerMinute(200), quota.WithMetering(llm.Bedrock(llm.BedrockLimits{
		Tokens:         llm.PerMinute(200000),
		OutputBurndown: func(string) float64 { return 5 },
	})))
}

func askAzure(ctx context.Context, hc *http.Client, cfg config, out io.Writer) error {
	endpoint := cfg.BaseURL
	if endpoint == "" {
		endpoint = os.Getenv("AZURE_OPENAI_ENDPOINT")
	}
	// Over HTTPS only: azure.WithUnsafeAllowHTTP, which lets it reach a
	// local server over HTTP, sends through a transport of its own, past
	// hc's Transport and its quota.
	client := openai.NewClient(
		azure.WithEndpoint(endpoint, azureAPIVersion),
		azure.WithAPIKey(os.Getenv("AZURE_OPENAI_API_KEY")),
		ooption.WithHTTPClient(hc),
	)
	params := openai.ChatCompletionNewParams{
		Model:               azureDeployment,
		MaxCompletionTokens: openai.Int(maxTokens),
		Messages:            []openai.ChatCompletionMessageParamUnion{openai.UserMessage(cfg.Prompt)},
	}
	return chat(ctx, client, params, "azure", out)
}

// bedrockClient returns a Bedrock runtime client that sends through hc,
// to baseURL unless it is empty.
func bedrockClient(hc *http.Client, baseURL string) *bedrockruntime.Client {
	region := os.Getenv("AWS_REGION")
	if region == "" {
		region = "us-east-1"
	}
	o := bedrockruntime.Options{
		Region:     region,
		HTTPClient: hc,
		Credentials: aws.CredentialsProviderFunc(func(context.Context) (aws.Credentials, error) {
			return aws.Credentials{AccessKeyID: os.Getenv("AWS_ACCESS_KEY_ID"), SecretAccessKey: os.Getenv("AWS_SECRET_ACCESS_KEY"),
				SessionToken: os.Getenv("AWS_SESSION_TOKEN"), Source: "environment"}, nil
		}),
	}
	if baseURL != "" {
		o.BaseEndpoint = aws.String(baseURL)
	}
	return bedrockruntime.New(o)
}

// converseInput is one user message of prompt, of at most max output
// tokens, to model.
func converseInput(model, prompt string, max int32) (*bedrockruntime.ConverseInput, *bedrockruntime.ConverseStreamInput) {
	msgs := []types.Message{{Role: types.ConversationRoleUser, Content: []types.ContentBlock{&types.ContentBlockMemberText{Value: prompt}}}}
	inf := &types.InferenceConfiguration{MaxTokens: aws.Int32(max)}
	return &bedrockruntime.ConverseInput{ModelId: aws.String(model), Messages: msgs, InferenceConfig: inf},
		&bedrockruntime.ConverseStreamInput{ModelId: aws.String(model), Messages: msgs, InferenceConfig: inf}
}

func askBedrock(ctx context.Context, hc *http.Client, cfg config, out io.Writer) error {
	client := bedrockClient(hc, cfg.BaseURL)
	in, streamIn := converseInput(bedrockModel, cfg.Prompt, maxTokens)
	resp, err := client.Converse(ctx, in)
	if err != nil {
		return err
	}
	text := ""
	if m, ok := resp.Output.(*types.ConverseOutputMemberMessage); ok {
		for _, b := range m.Value.Content {
			if t, ok := b.(*types.ContentBlockMemberText); ok {
				text += t.Value
			}
		}
	}
	printUsage(out, "bedrock", text, resp.Usage)

	sresp, err := client.ConverseStream(ctx, streamIn)
	if err != nil {
		return err
	}
	stream := sresp.GetStream()
	defer stream.Close()
	text = ""
	var usage *types.TokenUsage
	for ev := range stream.Events() {
		switch e := ev.(type) {
		case *types.ConverseStreamOutputMemberContentBlockDelta:
			if t, ok := e.Value.Delta.(*types.ContentBlockDeltaMemberText); ok {
				text += t.Value
			}
		case *types.ConverseStreamOutputMemberMetadata:
			usage = e.Value.Usage
		}
	}
	if err := stream.Err(); err != nil {
		return err
	}
	printUsage(out, "bedrock stream", text, usage)
	return nil
}

func printUsage(out io.Writer, label, text string, u *types.TokenUsage) {
	fmt.Fprintf(out, "%s: %s", label, text)
	if u != nil {
		fmt.Fprintf(out, " (%d input, %d output tokens)", aws.ToInt32(u.InputTokens), aws.ToInt32(u.OutputTokens))
	}
	fmt.Fprintln(out)
}
